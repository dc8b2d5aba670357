"""The native output format: its version, the config.json it writes (the source's fields under
`model_type: convert_mla`, plus the `mla` section) and the model-directory files that travel with
the weights (docs/design.md, "Output format"). `convert.mla.schema` checks what this writes."""

from convert._version import __version__

#: 2: own model_type `convert_mla`, the source's in mla.source_model_type
FORMAT_VERSION = 2
#: The model type of a converted directory (registered with transformers' Auto classes by `import convert`).
MLA_MODEL_TYPE = "convert_mla"
#: Files of a Hugging Face model directory that travel with the weights.
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def output_config(source_config: dict | None, plan, opts, infos) -> dict:
    """The converted checkpoint's config.json: the source's fields under our own model type
    (`convert_mla`, so that nothing loads it as the source architecture), plus `mla`.
    plan: the `ConversionPlan`; opts: the resolved `ConvertOptions`; infos: each layer's `LayerInfo`."""
    config = dict(source_config or {})
    source_model_type = config.get("model_type")
    if source_model_type is not None:
        config |= {"model_type": MLA_MODEL_TYPE, "architectures": ["MLAForCausalLM"]}
    return config | {"mla": _mla_section(plan, opts, infos, source_model_type)}


def _mla_section(plan, opts, infos, source_model_type) -> dict:
    """The `mla` section of the output config.json (docs/design.md, "Output format")."""
    spec = plan.spec
    layers = []
    for info, layer_plan in zip(infos, plan.layers):
        entry = info.to_config()
        entry["bias"] = sorted(name[: -len(".bias")] for name in layer_plan.shapes if name.endswith(".bias"))
        layers.append(entry)
    notes = sorted({note for info in infos for note in info.notes})
    return {
        "format_version": FORMAT_VERSION,
        "converter": f"convert {__version__}",
        "source_architecture": spec.arch.name,
        "source_model_type": source_model_type,
        "layout": opts.layout,
        "latent": opts.latent,
        "head_map": spec.head_map,
        "n_layers": spec.n_layers,
        "hidden_size": spec.hidden_size,
        "n_heads": spec.n_heads,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "softmax_scale": spec.softmax_scale,
        "rope": spec.arch.rope if spec.rope else None,
        "causal": spec.arch.causal,
        "layer_prefix": spec.layer_prefix_template,
        "layers": layers,
        "notes": notes,
        "compression": _compression_section(plan, opts),
    } | _qk_norm_fields(spec)


def _qk_norm_fields(spec) -> dict:
    """`qk_norm` (how q and k are RMS-normalised before RoPE), its `norm_eps` and
    `norm_unit_offset` (Gemma 3's norms scale by 1 + weight), `rotary_dim` (partial RoPE: the
    rotated dims per head), and `softcap` (Gemma 2's score soft-capping), each only where the
    source has it."""
    fields = {} if spec.qk_norm is None else {"qk_norm": spec.qk_norm, "norm_eps": spec.norm_eps}
    fields |= {"norm_unit_offset": True} if spec.arch.norm_unit_offset else {}
    fields |= {"rotary_dim": spec.rotary_dim} if spec.rotary_dim is not None else {}
    return fields | ({} if spec.softcap is None else {"softcap": spec.softcap})


def _compression_section(plan, opts) -> dict | None:
    """How a lossy conversion spent its cache budget (None when exact)."""
    if not opts.lossy:
        return None
    calib = opts.calibration_names  # None: weight SVD reads no text
    refined = opts.refine_steps if calib is not None else 0
    return {
        "method": opts.resolved_method,
        "allocation": opts.resolved_allocation if opts.rank is None else "uniform",
        "kv_cache_ratio": opts.kv_cache_ratio,
        "rank": opts.rank,
        "budget_dims": None if opts.kv_cache_ratio is None else plan.budget_dims(opts.kv_cache_ratio),
        "cache_dims": plan.cache_dims,
        "gqa_cache_dims": plan.gqa_cache_dims,
        "achieved_ratio": plan.cache_dims / plan.gqa_cache_dims,
        "calib": calib,
        "shrinkage": opts.shrinkage if calib is not None else None,
        "calib_tokens": opts.calib_tokens if calib is not None else None,
        "fisher_tokens": opts.fisher_tokens if calib is not None and opts.resolved_method == "fisher" else None,
        "calibration": opts.resolved_calibration if calib is not None else None,
        # Adam steps per layer fitting its attention output (convert.compress.refine; 0: none)
        "refine_steps": refined,
        # query positions each step fitted (None: every position of its window, or no steps)
        "refine_queries": opts.refine_queries if refined else None,
    } | (
        {"static_freqs": list(plan.spec.static_freqs), "nope_angle": opts.nope_angle} if plan.spec.static_freqs else {}
    )
