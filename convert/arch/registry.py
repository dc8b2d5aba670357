"""The supported model families, as data."""

import dataclasses
import re
from dataclasses import dataclass

from convert.errors import ConvertError


@dataclass(frozen=True)
class TensorRule:
    """One tensor a model family defines besides the attention weights.

    name: template, `{i}` the layer index. shape: the config fields giving each dim
    (None: the shape is checked with the attention's). when: "always"; "never" (the
    family's module has no such parameter); "untied" (required unless
    tie_word_embeddings, allowed either way when tied); or a config flag: present
    exactly when the flag is true.
    """

    name: str
    shape: tuple[str, ...] | None
    when: str = "always"


_LAYER = "model.layers.{i}."

#: Which key/value head each query head reads (`ArchSpec.head_map`; the math is `convert.linalg.heads`).
HEAD_MAPS = ("grouped", "tiled")


def _model_tensors(norms: tuple[str, ...]) -> list[TensorRule]:
    """Embedding, final norm, lm_head (unless tied) and each layer's `{norm}_layernorm`s."""
    d, v = "hidden_size", "vocab_size"
    return [
        TensorRule("model.embed_tokens.weight", (v, d)),
        TensorRule("model.norm.weight", (d,)),
        TensorRule("lm_head.weight", (v, d), "untied"),
        *(TensorRule(f"{_LAYER}{norm}_layernorm.weight", (d,)) for norm in norms),
    ]


def _llama_tensors(attention_bias: dict[str, str], norms: tuple[str, ...] = ("input", "post_attention")):
    """The tensors of a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3: same names and shapes;
    OLMo 2: the same with its norms after attention and MLP instead of before)."""
    layer = _LAYER
    d, inner = "hidden_size", "intermediate_size"
    rules = _model_tensors(norms) + [
        TensorRule(layer + "mlp.gate_proj.weight", (inner, d)),
        TensorRule(layer + "mlp.up_proj.weight", (inner, d)),
        TensorRule(layer + "mlp.down_proj.weight", (d, inner)),
        TensorRule(layer + "mlp.gate_proj.bias", (inner,), "mlp_bias"),
        TensorRule(layer + "mlp.up_proj.bias", (inner,), "mlp_bias"),
        TensorRule(layer + "mlp.down_proj.bias", (d,), "mlp_bias"),
    ]
    rules += [TensorRule(f"{layer}self_attn.{p}_proj.bias", None, when) for p, when in attention_bias.items()]
    return tuple(rules)


#: When each family has attention biases: Llama by its config flag, Qwen2 on q/k/v always, Mistral never.
_LLAMA_BIAS = dict.fromkeys("qkvo", "attention_bias")
_QWEN2_BIAS = {"q": "always", "k": "always", "v": "always", "o": "never"}
_MISTRAL_BIAS = dict.fromkeys("qkvo", "never")


@dataclass(frozen=True)
class ArchSpec:
    """How one model family names and computes its attention.

    layer_prefixes: templates for a layer's attention tensors, tried in order;
    `{i}` is the layer index, a template without it means a single layer.
    hf_attention: "module:Class" of transformers' own attention, the reference
    verification compares against (None: the seed's `MyGQA`). qk_norm: how q and k
    are RMS-normalised before RoPE: "head" per head (`q_norm`/`k_norm` weights (d,),
    Qwen3), "whole" over the whole projection (weights (H·d,) and (G·d,), OLMo 2),
    None without. pre_norm: whether each decoder layer normalises its attention's
    input (`input_layernorm`; OLMo 2 normalises outputs instead). gemma_scores: the
    family takes `query_pre_attn_scalar` (softmax scale) and `attn_logit_softcapping`
    (Gemma 2). norm_unit_offset: the q/k norms scale by (1 + weight), in float32 (Gemma 3's
    RMSNorm). module: transformers' module name of the family when it differs from `name`.
    fused_qkv: the projection holding q, k and v as one weight (Phi-3's `qkv_proj`, rows
    [q | k | v]), split on read into the q/k/v names above (None: stored separately).
    partial_rotary: the family rotates only the first `head_dim · partial_rotary_factor`
    dims of each head (config.json `partial_rotary_factor`); the rest are plain NoPE dims.
    post_attention_norm: the decoder normalises the attention's output (`post_attention_layernorm`)
    before adding it to the residual stream (Gemma 2/3, OLMo 2); elsewhere that norm is the MLP's input's.
    tied_by_default: transformers ties the embeddings when config.json has no `tie_word_embeddings`
    (Gemma 2/3, whose published configs leave the key out).
    """

    name: str
    model_types: tuple[str, ...]
    layer_prefixes: tuple[str, ...]
    q: str
    k: str
    v: str
    o: str
    head_map: str
    rope: str | None
    causal: bool
    hf_attention: str | None
    embed: str | None = None
    tensors: tuple[TensorRule, ...] = ()
    qk_norm: str | None = None
    pre_norm: bool = True
    gemma_scores: bool = False
    norm_unit_offset: bool = False
    fused_qkv: str | None = None
    partial_rotary: bool = False
    post_attention_norm: bool = False
    tied_by_default: bool = False

    @property
    def layer_pattern(self) -> str:
        """Regex matching the name of any tensor of a numbered layer (group 1: the index); '' if none is numbered."""
        numbered = next((t for t in self.layer_prefixes if "{i}" in t), None)
        if numbered is None:
            return ""
        before = numbered.split("{i}")[0]
        return "^" + re.escape(before) + r"(\d+)\."

    def tensor(self, prefix: str, proj: str, kind: str = "weight") -> str:
        """Full tensor name, e.g. ('model.layers.3.self_attn.', 'k') -> '...k_proj.weight'."""
        return f"{prefix}{getattr(self, proj)}.{kind}"


def _hf(
    name: str,
    attention: str,
    bias: dict[str, str],
    norms: tuple[str, ...] = ("input", "post_attention"),
    module: str | None = None,
) -> ArchSpec:
    """A Llama-style transformers family: q/k/v/o_proj under `model.layers.{i}.self_attn.`,
    rotate-half RoPE, causal; `norms` its decoder layers' norms, `module` transformers' module
    name when it differs from `name`. What a family adds is set on the entry with `dataclasses.replace`."""
    return ArchSpec(
        name=name,
        model_types=(name,),
        layer_prefixes=("model.layers.{i}.self_attn.",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_map="grouped",
        rope="rotate_half",
        causal=True,
        hf_attention=f"transformers.models.{module or name}.modeling_{module or name}:{attention}",
        embed="model.embed_tokens.weight",
        tensors=_llama_tensors(bias, norms),
    )


_GEMMA_NORMS = ("input", "post_attention", "pre_feedforward", "post_feedforward")


def _phi3_tensors() -> tuple[TensorRule, ...]:
    """Phi-3's decoder: Llama's norms, a fused `gate_up_proj` [gate | up] and no attention biases
    (a fused `qkv_proj.bias` would be dropped by the split, so it is refused by name)."""
    d = "hidden_size"
    return (
        *_model_tensors(("input", "post_attention")),
        TensorRule(_LAYER + "mlp.gate_up_proj.weight", ("gate_up_size", d)),
        TensorRule(_LAYER + "mlp.down_proj.weight", (d, "intermediate_size")),
        *(TensorRule(f"{_LAYER}self_attn.{p}_proj.bias", None, "never") for p in ("q", "k", "v", "o", "qkv")),
    )


def _mixtral_tensors() -> tuple[TensorRule, ...]:
    """Mixtral's decoder as transformers' modules hold it (a checkpoint's per-expert w1/w2/w3 are read
    stacked, `convert.layouts`): the router and the stacked experts, passed through untouched."""
    d, e = "hidden_size", "num_local_experts"
    return (
        *_model_tensors(("input", "post_attention")),
        TensorRule(_LAYER + "mlp.gate.weight", (e, d)),
        TensorRule(_LAYER + "mlp.experts.gate_up_proj", (e, "gate_up_size", d)),
        TensorRule(_LAYER + "mlp.experts.down_proj", (e, d, "intermediate_size")),
        *(TensorRule(f"{_LAYER}self_attn.{p}_proj.bias", None, "never") for p in "qkvo"),
    )


ARCHS: dict[str, ArchSpec] = {
    "llama": _hf("llama", "LlamaAttention", _LLAMA_BIAS),
    "mistral": _hf("mistral", "MistralAttention", _MISTRAL_BIAS),
    "qwen2": _hf("qwen2", "Qwen2Attention", _QWEN2_BIAS),
    # Qwen3: Llama's layout plus per-head RMSNorm of q and k before RoPE (docs/math.md, "Biases and layer features").
    "qwen3": dataclasses.replace(_hf("qwen3", "Qwen3Attention", _LLAMA_BIAS), qk_norm="head"),
    # OLMo 2: RMSNorm of q and k over the whole projection (all heads at once), norms after
    # attention and MLP.
    "olmo2": dataclasses.replace(
        _hf("olmo2", "Olmo2Attention", _LLAMA_BIAS, norms=("post_attention", "post_feedforward")),
        qk_norm="whole",
        pre_norm=False,
        post_attention_norm=True,
    ),
    # Gemma 2: scores scaled by query_pre_attn_scalar^-1/2 and soft-capped, norms before and after
    # attention and MLP, alternating sliding-window layers (transformers' masks), tied embeddings.
    "gemma2": dataclasses.replace(
        _hf("gemma2", "Gemma2Attention", _LLAMA_BIAS, _GEMMA_NORMS),
        gemma_scores=True,
        post_attention_norm=True,
        tied_by_default=True,
    ),
    # Gemma 3 (text): Gemma 2's layout, per-head q/k norms scaling by (1 + weight), one RoPE base for
    # sliding-window layers and another for global ones (the model hands each layer its own cos/sin).
    "gemma3_text": dataclasses.replace(
        _hf("gemma3_text", "Gemma3Attention", _LLAMA_BIAS, _GEMMA_NORMS, module="gemma3"),
        qk_norm="head",
        gemma_scores=True,
        norm_unit_offset=True,
        post_attention_norm=True,
        tied_by_default=True,
    ),
    # Mixtral: Mistral's attention, a mixture-of-experts MLP (router + experts) passed through.
    "mixtral": dataclasses.replace(_hf("mixtral", "MixtralAttention", _MISTRAL_BIAS), tensors=_mixtral_tensors()),
    # Phi-3 (and Phi-3.5 / Phi-4-mini, which share model_type phi3): q, k and v fused in qkv_proj,
    # gate and up fused in gate_up_proj (passed through), partial RoPE where the config has it.
    "phi3": dataclasses.replace(
        _hf("phi3", "Phi3Attention", _MISTRAL_BIAS),
        tensors=_phi3_tensors(),
        fused_qkv="qkv_proj",
        partial_rotary=True,
    ),
    # The seed's MyGQA: per-layer W_Q/W_K/W_V/W_O, no RoPE, no mask, tiled head map.
    "seed": ArchSpec(
        name="seed",
        model_types=(),
        layer_prefixes=("layers.{i}.", ""),
        q="W_Q",
        k="W_K",
        v="W_V",
        o="W_O",
        head_map="tiled",
        rope=None,
        causal=False,
        hf_attention=None,
    ),
}

# Families with q/k norm that are not entered yet (qwen3, olmo2 and gemma3_text are; docs/math.md,
# "Biases and layer features"). Each is refused with what it adds beyond the entered families' norms.
QK_NORM_MODEL_TYPES = {
    "qwen3_moe": "a mixture-of-experts MLP",
    "qwen3_next": "hybrid linear attention",
    "gemma3": "a vision tower (multimodal); its text-only checkpoints (model_type gemma3_text) convert",
    "olmo3": "a q/k norm over the whole projection (all heads at once)",
    "chameleon": "a multimodal model with per-head layer norms",
}


#: The model types of checkpoints that already have Multi-head Latent Attention: convert's own
#: output, and DeepSeek's (which its transformers and vllm exports write).
MLA_MODEL_TYPES = ("convert_mla", "deepseek_v2", "deepseek_v3")


def refuse_converted(model_type: str | None, config: dict | None) -> None:
    """A checkpoint that already has MLA attention is refused as such (not as "unsupported"),
    naming the convert version that wrote it when it says so."""
    config = config or {}
    mla, export = config.get("mla"), config.get("convert_export")
    if model_type not in MLA_MODEL_TYPES and mla is None and export is None:
        return
    if isinstance(mla, dict) or isinstance(export, dict):
        by = (mla if isinstance(mla, dict) else {}).get("converter") or "convert"
        record = mla if isinstance(mla, dict) else export
        assert isinstance(record, dict)  # mla is not a dict, so export is (the test above)
        source = record.get("source_model_type", "GQA")
        raise ConvertError(
            f"config.json: already converted to MLA (by {by}, from a {source} model); convert its {source} "
            "source instead, or re-check this one with `convert verify SOURCE THIS`"
        )
    raise ConvertError(
        f"config.json model_type={model_type!r} already has Multi-head Latent Attention; there is nothing to "
        "convert: point at a GQA checkpoint (Llama, Qwen2, ...)"
    )


def tied_embeddings(config: dict) -> bool:
    """Whether the model's lm_head is its embedding: config.json's `tie_word_embeddings`, or where
    the key is absent the family's default as transformers applies it (`ArchSpec.tied_by_default`)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    model_type = (config.get("mla") or {}).get("source_model_type") or config.get("model_type")  # converted or not
    arch = next((a for a in ARCHS.values() if model_type in a.model_types), None)
    return arch is not None and arch.tied_by_default


def find_arch(model_type: str | None, requested: str | None, config: dict | None = None) -> ArchSpec:
    """The ArchSpec for a config's model_type and/or the `--arch` flag (`config`: the whole
    config.json, to say which convert wrote a checkpoint that is already MLA)."""
    refuse_converted(model_type, config)
    if model_type in QK_NORM_MODEL_TYPES:
        raise ConvertError(
            f"config.json model_type={model_type!r} normalises q and k and has {QK_NORM_MODEL_TYPES[model_type]}, "
            "which convert does not handle yet; the q/k-norm families that convert are qwen3, olmo2 and gemma3_text"
        )
    by_type = next((a for a in ARCHS.values() if model_type in a.model_types), None)
    if model_type is not None and by_type is None:
        raise ConvertError(
            f"config.json model_type={model_type!r} is not a supported architecture; supported: "
            f"{', '.join(a for a in ARCHS if a != 'seed')} (or --arch seed for the seed's W_Q/W_K/W_V/W_O notation)"
        )
    if requested is not None and requested not in ARCHS:
        raise ConvertError(f"--arch {requested!r} is unknown; choose one of {', '.join(ARCHS)}")
    if by_type is not None and requested is not None and requested != by_type.name:
        raise ConvertError(
            f"--arch {requested} contradicts config.json model_type={model_type!r}; drop --arch or fix config.json"
        )
    if by_type is None and requested is None:
        raise ConvertError(
            "the architecture is unknown (no config.json beside the checkpoint, or one without model_type) and "
            f"no --arch: pass --arch ({', '.join(ARCHS)}) and the head counts (--n-heads, --n-kv-heads)"
        )
    if by_type is not None:
        return by_type
    assert requested is not None  # refused above when both are None
    return ARCHS[requested]
