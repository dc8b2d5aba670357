"""The Python API: plan -> transform -> write -> verify. No click, no printing.

result = convert.gqa2mla("model_dir", "model_dir-mla")
mla_sd = convert.convert_state_dict(model.state_dict(), model.config)
mla_model = convert.to_mla(model)
"""

import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from convert import compress
from convert._version import __version__
from convert.arch import AttentionSpec
from convert.errors import ConvertError
from convert.heap import release_freed_memory
from convert.hf import MLA_MODEL_TYPE
from convert.io import Checkpoint, CheckpointWriter, open_checkpoint, output_lock, parse_size
from convert.layouts import attention_view
from convert.options import ConvertOptions
from convert.plan import ConversionPlan, budget_dims, check_rank, layer_weighting, make_plan, resolve_spec
from convert.progress import progress
from convert.source import LazyTensors, StateDictSource, read_layer
from convert.text import text_token_ids
from convert.transform import LayerInfo, convert_layer

FORMAT_VERSION = 2  # 2: own model_type `convert_mla`, the source's in mla.source_model_type
# Files of a Hugging Face model directory that travel with the weights.
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


@dataclass
class ConversionResult:
    """What `gqa2mla` did. `passed` is None when verification was skipped."""

    output: Path
    config: dict
    layers: list[LayerInfo]
    sizes: dict
    timings: dict
    report: dict | None = None
    notes: list[str] = field(default_factory=list)
    plan: ConversionPlan | None = None

    @property
    def passed(self) -> bool | None:
        return None if self.report is None else self.report["verdict"] == "PASS"


class MLAStateDict(dict):
    """The converted state dict; `.config` is the output config (with its `mla` section),
    `.plan` the conversion plan (sizes, ranks, cache)."""

    config: dict
    layers: list[LayerInfo]
    plan: ConversionPlan


# ------------------------------------------------------------------ calibration


def _calibration(source, spec: AttentionSpec, opts: ConvertOptions):
    """Input statistics of every layer on the calibration text (None when not needed)."""
    if not opts.lossy or opts.resolved_method == "svd":
        return None
    if spec.arch.hf_attention is None:
        raise ConvertError(
            f"--calib needs a transformers architecture to run; {spec.arch.name} has none: use --method svd"
        )
    config = source.config or {}
    source = getattr(source, "module_source", source)  # as the original model's modules read it (Phi-3: unsplit)
    ids = _calib_ids(source, opts)
    if opts.resolved_method == "fisher":  # one decoder layer at a time, forward then backward
        bar = _bar("calibrating (Fisher)", "layer", opts.progress)
        return compress.fisher_calibrate_streamed(source, config, ids, spec.n_layers, progress=bar)
    return compress.calibrate(source, config, ids, spec.n_layers, progress=_bar("calibrating", "layer", opts.progress))


def _calib_ids(source, opts: ConvertOptions) -> torch.Tensor:
    """The calibration token ids (1, N ≤ --calib-tokens): given, or --calib tokenized."""
    ids = opts.calib
    if not isinstance(ids, torch.Tensor):
        root = getattr(source, "root", Path(opts.calib).parent)
        vocab = (source.config or {})["vocab_size"]
        ids = text_token_ids(Path(opts.calib), root, vocab, opts.calib_tokens, what="--calib")
    return ids[:, : opts.calib_tokens]


def _bar(desc: str, unit: str, enabled: bool):
    """Progress over an iterable: a bar on a terminal, log lines otherwise, nothing when quiet."""
    return lambda items: progress(items, desc, unit, enabled)


def output_config(source_config: dict | None, plan: ConversionPlan, opts: ConvertOptions, infos) -> dict:
    """The converted checkpoint's config.json: the source's fields under our own model type
    (`convert_mla`, so that nothing loads it as the source architecture), plus `mla`."""
    config = dict(source_config or {})
    source_model_type = config.get("model_type")
    if source_model_type is not None:
        config |= {"model_type": MLA_MODEL_TYPE, "architectures": ["MLAForCausalLM"]}
    return config | {"mla": _mla_section(plan, opts, infos, source_model_type)}


def _mla_section(plan: ConversionPlan, opts: ConvertOptions, infos: list[LayerInfo], source_model_type) -> dict:
    """The `mla` section of the output config.json (README, "Output format")."""
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


def _qk_norm_fields(spec: AttentionSpec) -> dict:
    """`qk_norm` (how q and k are RMS-normalised before RoPE), its `norm_eps` and
    `norm_unit_offset` (Gemma 3's norms scale by 1 + weight), `rotary_dim` (partial RoPE: the
    rotated dims per head), and `softcap` (Gemma 2's score soft-capping), each only where the
    source has it."""
    fields = {} if spec.qk_norm is None else {"qk_norm": spec.qk_norm, "norm_eps": spec.norm_eps}
    fields |= {"norm_unit_offset": True} if spec.arch.norm_unit_offset else {}
    fields |= {"rotary_dim": spec.rotary_dim} if spec.rotary_dim is not None else {}
    return fields | ({} if spec.softcap is None else {"softcap": spec.softcap})


def _compression_section(plan: ConversionPlan, opts: ConvertOptions) -> dict | None:
    """How a lossy conversion spent its cache budget (None when exact)."""
    if not opts.lossy:
        return None
    calib = (
        opts.calib if opts.calib is None or isinstance(opts.calib, (str, Path)) else f"{opts.calib.shape[-1]} token ids"
    )
    return {
        "method": opts.resolved_method,
        "allocation": opts.resolved_allocation if opts.rank is None else "uniform",
        "kv_cache_ratio": opts.kv_cache_ratio,
        "rank": opts.rank,
        "budget_dims": None if opts.kv_cache_ratio is None else budget_dims(plan.spec, opts.kv_cache_ratio),
        "cache_dims": plan.cache_dims,
        "gqa_cache_dims": plan.gqa_cache_dims,
        "achieved_ratio": plan.cache_dims / plan.gqa_cache_dims,
        "calib": None if calib is None else str(calib),
        "calib_tokens": opts.calib_tokens if calib is not None else None,
        "calibration": opts.resolved_calibration if calib is not None else None,
    } | (
        {"static_freqs": list(plan.spec.static_freqs), "nope_angle": opts.nope_angle} if plan.spec.static_freqs else {}
    )


# ------------------------------------------------------------------ converting


def _convert_layers(source, plan: ConversionPlan, opts: ConvertOptions, stats, sink) -> list[LayerInfo]:
    """Convert layer by layer, handing each output tensor (cast to the checkpoint's dtype) to `sink`
    in layer order. Without sequential calibration, small layers are factored two at a time."""
    spec, infos = plan.spec, []
    sequential = _sequential(source, plan, opts, stats)
    # The absorbed products come cast to the checkpoint's dtype (small), unless the sequential
    # calibration runs the layer next and wants them in float64.
    dtype = plan.dtype if sequential is None else torch.float64

    def convert_one(layer: int):
        weights = read_layer(source, spec, layer)
        weighting = layer_weighting(spec, opts, stats, weights, layer)
        if sequential is not None:
            weighting = _sequential_weighting(
                weighting, sequential.stats(layer), spec.rope and weights.k_bias is not None
            )
        return convert_layer(weights, spec, opts.latent, opts.layout, plan.layers[layer].ranks, weighting, dtype)

    workers = 1 if sequential is not None else plan.layer_workers()
    layers = _bar("converting", "layer", opts.progress)(range(spec.n_layers))
    for layer, (tensors, info) in zip(layers, in_order(convert_one, range(spec.n_layers), workers)):
        prefix = spec.prefix(layer)
        for name in plan.layers[layer].shapes:
            sink(prefix + name, tensors[name].to(plan.dtype).contiguous())
        infos.append(info)
        if sequential is not None:
            mla = output_config(source.config, plan, opts, infos)["mla"]
            sequential.advance(layer, mla, {name: tensors[name] for name in plan.layers[layer].shapes})
        del tensors  # before the next layer's: a bounded number of layers in memory
    return infos


def in_order(fn, items, workers: int):
    """fn(item) for each item, yielded in order, with at most `workers` running at once on
    threads (torch releases the GIL), each torch op on one thread meanwhile; workers=1 runs inline."""
    if workers <= 1:
        yield from map(fn, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            pending = deque()
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) == workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        torch.set_num_threads(threads)


def _sequential(source, plan: ConversionPlan, opts: ConvertOptions, stats):
    """The two-stream calibration of `--calibration sequential` (None when not asked or nothing is compressed)."""
    if opts.resolved_calibration != "sequential" or stats is None or not opts.lossy:
        return None
    from convert.compress.sequential import SequentialCalibration

    module_source = getattr(source, "module_source", source)
    return SequentialCalibration(module_source, source.config or {}, _calib_ids(module_source, opts))


def _sequential_weighting(weighting, layer_stats, affine_key: bool):
    """The layer's weighting with its input moments measured in the compressed model, and the cross
    moments that refit its up-projections to the original layer's outputs (Fisher rows unchanged)."""
    key_moment, key_cross = layer_stats.augmented() if affine_key else (layer_stats.moment, layer_stats.cross)
    if layer_stats.normed_keys is not None:  # q/k norm: the normed keys are what is compressed
        key_moment, key_cross = layer_stats.normed_keys
    weighting.key_moment, weighting.key_cross = key_moment, key_cross
    weighting.value_moment, weighting.value_cross = layer_stats.moment, layer_stats.cross
    return weighting


def _plan(source, config: dict | None, opts: ConvertOptions, verifying: bool):
    """Spec, calibration (when compressing with real inputs) and the plan built from them:
    (plan, stats, options as resolved: an explicit exact --rank is the exact conversion).

    Every refusal that needs no weights comes first, before calibration's work.
    """
    spec = resolve_spec(source, config, opts)
    opts = check_rank(source, spec, opts)
    opts.check_calibrated()
    if verifying:
        opts.check_verifiable()
    stats = _calibration(source, spec, opts)
    return make_plan(source, spec, opts, stats), stats, opts


def convert_state_dict(state_dict: dict[str, torch.Tensor], config, **options) -> MLAStateDict:
    """Convert an in-memory GQA state dict; nothing touches disk.

    config: the model's config (a transformers config or a dict; None for a
    bare seed-notation state dict with `arch="seed", n_heads=...`). options:
    the fields of `ConvertOptions` (output and verification fields are ignored).
    Returns the MLA state dict (attention tensors replaced, the rest shared);
    its `.config` is the output config with the `mla` section.
    """
    opts = ConvertOptions.from_kwargs(**{"progress": False, **options})
    config = config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)
    source = attention_view(StateDictSource(state_dict, config), config)
    plan, stats, opts = _plan(source, config, opts, verifying=False)
    # the view's tensors: a Mixtral's stacked experts as its modules hold them, the rest the caller's own
    result = MLAStateDict((k, source.get(k)) for k in source.keys() if k not in plan.replaced)
    result.layers = _convert_layers(source, plan, opts, stats, result.__setitem__)
    result.config = output_config(config, plan, opts, result.layers)
    result.plan = plan
    return result


def to_mla(model, **options):
    """Convert a live transformers GQA model in memory and return the MLA causal LM.

    model: a causal LM of a supported architecture (its `config` and `state_dict()`
    are read, nothing is changed). options: the fields of `ConvertOptions`, as for
    `gqa2mla` (layout, rank, kv_cache_ratio, method, calib as a text path or token
    ids (1, N), ...); output and verification fields do not apply. Returns the same
    module, with the same weights, as `load_mla_model` returns for the directory
    `gqa2mla` writes from this model: on the model's device, in its dtype, in eval
    mode, an `nn.Module` whose `forward(input_ids, labels=...)` gives the usual loss.
    With target="transformers" or "vllm" it is the export's DeepseekV3ForCausalLM, as
    `convert.verify.load_export` loads the directory `gqa2mla` writes (the vllm export
    with vLLM's latent-norm eps), to train or evaluate in memory; to serve healed weights,
    heal the written export (`heal(export_dir, ...)`). No disk is involved.
    """
    from convert.mla.model import build_mla_model

    opts = ConvertOptions.from_kwargs(**{"progress": False, "verify": False, **options})  # nothing to verify here
    parameter = next(model.parameters())
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if opts.target != "mla":
        return _export_model(state, model.config, opts, parameter.dtype, parameter.device)
    converted = convert_state_dict(state, model.config, **options)
    return build_mla_model(converted.config, converted, dtype=parameter.dtype, device=parameter.device)


def _export_model(state: dict[str, torch.Tensor], config, opts: ConvertOptions, dtype: torch.dtype, device="cpu"):
    """`to_mla`'s export targets: the DeepseekV3ForCausalLM of --target transformers or vllm, built
    from the source's state dict in memory, after the same refusals as a conversion."""
    from convert.hf import build_causal_lm, load_strict

    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    source = attention_view(StateDictSource(state, config), config)
    resolve_spec(source, config, opts)  # the same checks and refusals as the mla target
    if opts.target == "transformers":
        from convert.targets import to_deepseek_v3

        tensors, export_config = to_deepseek_v3(state, config)
    else:
        _, export_config, tensors = _vllm_tensors(source, state, opts)
        tensors = dict(tensors)
    export = build_causal_lm(export_config, dtype, device=device)
    load_strict(export, tensors, f"the --target {opts.target} export")
    if opts.target == "vllm":
        from convert.targets.vllm import match_vllm_norms

        match_vllm_norms(export)
    return export.eval()


# ------------------------------------------------------------------ files


def default_output(src: Path) -> Path:
    """`<name>-mla` beside the input: ckpt.safetensors -> ckpt-mla/, model_dir -> model_dir-mla/."""
    src = Path(src)
    name = src.stem if src.is_file() else src.name
    return src.resolve().parent / f"{name}-mla"


def _copy_aux_files(source: Checkpoint, writer: CheckpointWriter) -> None:
    if not source.path.is_dir():
        return
    for name in AUX_FILES:
        if (source.root / name).is_file():
            writer.copy_file(name, source.root / name)


def gqa2mla(src, output=None, **options) -> ConversionResult:
    """Convert a GQA checkpoint into an MLA checkpoint directory, then verify it.

    src: a .safetensors file, a sharded directory (model.safetensors.index.json)
    or a Hugging Face model directory. output: the directory to create (default
    `<name>-mla` beside the input); written to a temporary sibling and swapped
    into place only when complete. It must not be, contain or lie inside an
    input; an existing one is replaced only with `force=True` and only if
    convert wrote it (its `.convert-manifest.json`). options: the fields of
    `ConvertOptions`.

    Raises ConvertError (exit 2) for bad input and EnvironmentFailure (exit 3)
    for disk, permission or lock problems; nothing is left on disk either way. A
    verification FAIL does not raise: the output is kept with its report; check
    `.passed`.
    """
    opts = ConvertOptions.from_kwargs(**options)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    src = Path(src)
    output = Path(output) if output is not None else default_output(src)
    calib = opts.calib if isinstance(opts.calib, (str, Path)) else None
    with open_checkpoint(src) as stored, output_lock(output, [src, opts.text, calib], opts.force):
        source = attention_view(stored, stored.config)  # Phi-3: q/k/v split out of qkv_proj
        if opts.target == "transformers":
            return _export_transformers(src, source, output, opts, start)
        if opts.target == "vllm":
            return _export_vllm(src, source, output, opts, start)
        plan, stats, opts = _plan(source, source.config, opts, verifying=opts.verify)
        timings["plan_s"] = time.perf_counter() - start
        metadata = {"format": "pt", "mla_format_version": str(FORMAT_VERSION)}
        shard_size = parse_size(opts.max_shard_size)
        with CheckpointWriter(output, plan.output_tensors(), shard_size, opts.force, metadata) as writer:
            t0 = time.perf_counter()
            for name in source.keys():
                if name not in plan.replaced:
                    span = source.raw_span(name)  # None: assembled in memory (Mixtral's stacked experts)
                    if span is not None:
                        writer.copy_span(name, *span)
                    else:
                        writer.write_chunks(name, source.raw_chunks(name))
            infos = _convert_layers(source, plan, opts, stats, writer.write)
            release_freed_memory()  # the conversion's freed layers, before verification builds its own
            config = output_config(source.config, plan, opts, infos)
            final, report = _finish(writer, source, src, config, opts, timings, t0)
    timings["total_s"] = time.perf_counter() - start
    return ConversionResult(final, config, infos, plan.sizes(), timings, report, config["mla"]["notes"], plan)


def _finish(writer: CheckpointWriter, source: Checkpoint, src: Path, config: dict, opts, timings: dict, t0: float):
    """config.json and the model directory's other files, verification, then the atomic commit.
    Returns (the committed output directory, the report or None)."""
    writer.write_json("config.json", config)
    _copy_aux_files(source, writer)
    writer.flush()  # the writer thread has copied what it reads from the source
    timings["convert_s"] = time.perf_counter() - t0
    source.close()  # its mapped pages leave memory; verification opens the checkpoint again
    report = _verify_into(writer, src, opts, timings) if opts.verify else None
    return writer.commit(), report


def _verify_into(writer: CheckpointWriter, src: Path, opts: ConvertOptions, timings: dict) -> dict:
    """Verify the not-yet-committed output and write its report beside the weights."""
    from convert.verify import verify, write_report

    t0 = time.perf_counter()
    writer.write_index()  # a sharded output must open as a checkpoint before it is committed
    report = verify(src, writer.tmp_dir, opts)
    report["inputs"]["converted"]["path"] = str(writer.output)  # where it will be once committed
    timings["verify_s"] = time.perf_counter() - t0
    write_report(report, writer.tmp_dir)
    return report


# ------------------------------------------------------------------ export targets


def _export_transformers(src: Path, source: Checkpoint, output: Path, opts: ConvertOptions, start: float):
    """`--target transformers`: an exact DeepseekV3ForCausalLM checkpoint (convert.targets), built
    in memory from the whole source, written and verified like a conversion."""
    from convert.targets import to_deepseek_v3

    spec = resolve_spec(source, source.config, opts)  # the same checks and refusals as the mla target
    tensors, config = to_deepseek_v3({name: source.get(name) for name in source.keys()}, source.config or {})
    notes = [
        "DeepseekV3ForCausalLM for stock transformers: exact, but not for vLLM (it ignores the longrope "
        "frequencies and the attention biases this export relies on); transformers' DeepseekV3 caches per-head "
        "keys and values, not the latent"
    ]
    layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    return _write_export(src, source, output, opts, start, layout, tensors.items(), config, lambda: notes, spec)


#: How the vllm target's compressed latent is calibrated unless --calibration says: original measured
#: better at 75% and 25% of the latent's need on SmolLM2, sequential at 50% (bench/vllm_latent.py).
VLLM_CALIBRATION = "original"


def _export_vllm(src: Path, source: Checkpoint, output: Path, opts: ConvertOptions, start: float):
    """`--target vllm`: a DeepseekV3ForCausalLM in vLLM's MLA shape (convert.targets.vllm); calibrated
    on --calib when there is more than one key/value head. Every refusal comes before calibration."""
    source_spec = resolve_spec(source, source.config, opts)  # the same checks and refusals as the mla target
    state_dict = LazyTensors(source)  # read a tensor at a time as the export writes it
    layout, config, tensors = _vllm_tensors(source, state_dict, opts)
    notes = lambda: [vllm_note(config["convert_export"])]  # complete once every tensor is written
    return _write_export(src, source, output, opts, start, layout, tensors, config, notes, source_spec)


def _vllm_tensors(source, state_dict, opts: ConvertOptions):
    """The vllm export of `source` (a checkpoint or an in-memory source) as `vllm_export` gives it:
    (layout, config_dict, an iterator of (name, tensor)), calibrated on --calib when given.
    state_dict: the source's tensors by name (read lazily from a checkpoint)."""
    from convert.targets.vllm import (
        SequentialLatents,
        check_vllm_exportable,
        needs_calibration,
        needs_compression,
        resolve_vllm_spec,
        rotation_fit_observer,
        vllm_export,
    )

    config, src_view, spec = resolve_vllm_spec(state_dict, source.config or {})
    dtype = src_view.dtype(spec.tensor(0, "q"))
    check_vllm_exportable(config, spec, src_view, dtype, opts.calib is not None or not needs_calibration(spec, config))
    lossy = needs_calibration(spec, config) or needs_compression(spec, config["hidden_size"])
    if lossy and opts.verify and (opts.text is None or opts.max_ppl_ratio is None):
        raise ConvertError(
            "--target vllm is lossy for this model (vLLM rotates 64 key dims shared by all heads at one frequency "
            "set): verification judges it by perplexity on real text, so pass --text FILE (a text unlike --calib) "
            "and --max-ppl-ratio R (e.g. 1.1), or --no-verify"
        )
    stats = sequential = None
    if opts.calib is not None:
        ids = _calib_ids(source, opts)
        bar = _bar("calibrating", "layer", opts.progress)
        observe = rotation_fit_observer(src_view, spec, config) if needs_calibration(spec, config) else None
        stats = compress.calibrate(source, config, ids, spec.n_layers, progress=bar, observe=observe)
        if needs_compression(spec, config["hidden_size"]):  # the latent is compressed: weigh it in loss units
            fisher = compress.fisher_calibrate_streamed(
                source, config, ids, spec.n_layers, progress=_bar("fisher statistics", "layer", opts.progress)
            )
            for layer_stats, layer_fisher in zip(stats, fisher):
                layer_stats.key_fisher, layer_stats.value_fisher = layer_fisher.key_fisher, layer_fisher.value_fisher
            if (opts.calibration or VLLM_CALIBRATION) == "sequential":
                sequential = SequentialLatents(getattr(source, "module_source", source), config, ids)
    return vllm_export(state_dict, config, stats, sequential=sequential)


def vllm_note(info: dict) -> str:
    """What the vllm target keeps and loses, in one paragraph (report and result notes)."""
    G, d = info["n_kv_heads"], info["head_dim"]
    cache, gqa = info["kv_cache_dims_per_token_per_layer"], info["gqa_cache_dims_per_token_per_layer"]
    size = "LARGER than" if cache > gqa else "smaller than"
    text = (
        f"DeepseekV3ForCausalLM for vLLM's MLA: {cache} cached values per token per layer, {size} the original GQA "
        f"cache ({gqa} = 2·{G}·{d}); the saving comes at 7B+ (Llama-3-8B: 2048 -> 576). "
    )
    if info["exact"]:
        return text + "Exact: one key/value head of head_dim 64 fits vLLM's 64 shared rotary dims."
    kept = [e for e in info["rotary_key_energy_kept"] if e is not None]
    share = f" (they carry {100 * sum(kept) / len(kept):.1f}% of the key energy)" if kept else ""
    stand_in = {
        "fit": " and replaced by fixed 2x2 maps per head and frequency, on those terms and on the rotary query, "
        "fitted on the calibration text (least squares on key samples drawn from the attention)",
        "nope": " (the terms kept unrotated)",
    }.get(info.get("position_free_terms"), f" (stand-in: {info.get('position_free_terms')})")
    f = info.get("frequency_fold", 1)
    components = f"{G} key heads' rotary pairs" if f == 1 else f"{G} key heads' {f} folded frequency pairs"
    folded = (
        f"; head_dim {d} folds {f} source frequencies into each of vLLM's 32 (the others turn at the slot's)"
        if f > 1
        else ""
    )
    latent = ""
    if info.get("latent_compressed"):
        latent = (
            f" The latent is COMPRESSED: the position-free keys and values need {info['latent_content_dims']} dims, "
            f"vLLM holds {info['latent_dims_used']} ({info['latent_weighting']}-weighted factorization)."
        )
    return text + (
        f"LOSSY: vLLM rotates only 64 key dims shared by all heads, one frequency set{folded}; of the {components} "
        f"per rotary slot the principal mixture stays rotary{share}, the other {G * f - 1} become position-free "
        f"(NoPE) dims in the latent, their rotation dropped{stand_in}.{latent} Compare with transformers' "
        "DeepseekV3 after convert.targets.vllm.match_vllm_norms(model)."
    )


def _write_export(src, source: Checkpoint, output: Path, opts, start, layout: dict, tensors, config: dict, notes, spec):
    """Write an export target's tensors (an iterable of (name, tensor) in `layout`'s names, each
    written as it comes) and config, then verify and commit like a conversion. notes: called
    once every tensor is written (what an export says of itself can depend on all of them)."""
    timings: dict[str, float] = {}
    timings["plan_s"] = time.perf_counter() - start
    with CheckpointWriter(output, layout, parse_size(opts.max_shard_size), opts.force, {"format": "pt"}) as writer:
        t0 = time.perf_counter()
        bar = progress(tensors, "exporting", "tensor", opts.progress, total=len(layout))
        for name, tensor in bar:
            writer.write(name, tensor.contiguous())
        final, report = _finish(writer, source, src, config, opts, timings, t0)
    timings["total_s"] = time.perf_counter() - start
    sizes = _export_sizes(source, spec, opts, layout, config)
    return ConversionResult(final, config, [], sizes, timings, report, notes())


def _export_sizes(source: Checkpoint, spec: AttentionSpec, opts: ConvertOptions, layout: dict, config: dict) -> dict:
    """Attention parameters and the KV cache per token (what a DeepSeek-V3 MLA runtime
    caches: latent + rotary key), before and after, in the checkpoint's dtype."""
    source_plan = make_plan(source, spec, opts)  # headers only
    after_params = sum(math.prod(shape) for name, (shape, _) in layout.items() if ".self_attn." in name)
    after_dims = config["num_hidden_layers"] * config["convert_export"]["kv_cache_dims_per_token_per_layer"]
    size = torch.empty((), dtype=source_plan.dtype).element_size()
    return source_plan.sizes() | {
        "attention_params_after": after_params,
        "attention_bytes_after": after_params * size,
        "kv_cache_dims_per_token_after": after_dims,
        "kv_cache_bytes_per_token_after": after_dims * size,
    }
