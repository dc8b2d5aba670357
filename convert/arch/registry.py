"""The supported model families, as data."""

from dataclasses import dataclass

from convert.errors import ConvertError


@dataclass(frozen=True)
class ArchSpec:
    """How one model family names and computes its attention.

    layer_prefixes: templates for a layer's attention tensors, tried in order;
    `{i}` is the layer index, a template without it means a single layer.
    hf_attention: "module:Class" of transformers' own attention, the reference
    verification compares against (None: the seed's `MyGQA`).
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

    def tensor(self, prefix: str, proj: str, kind: str = "weight") -> str:
        """Full tensor name, e.g. ('model.layers.3.self_attn.', 'k') -> '...k_proj.weight'."""
        return f"{prefix}{getattr(self, proj)}.{kind}"


def _hf(name: str, attention: str, model_types: tuple[str, ...] | None = None) -> ArchSpec:
    return ArchSpec(
        name=name,
        model_types=model_types or (name,),
        layer_prefixes=("model.layers.{i}.self_attn.",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_map="grouped",
        rope="rotate_half",
        causal=True,
        hf_attention=f"transformers.models.{name}.modeling_{name}:{attention}",
        embed="model.embed_tokens.weight",
    )


ARCHS: dict[str, ArchSpec] = {
    "llama": _hf("llama", "LlamaAttention"),
    "mistral": _hf("mistral", "MistralAttention"),
    "qwen2": _hf("qwen2", "Qwen2Attention"),
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

# Per-head normalisation of q and k is a nonlinearity on W^K y: no linear latent
# reproduces it, so these families are refused until a design exists (DESIGN §5).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text", "olmo2", "olmo3", "chameleon")


def find_arch(model_type: str | None, requested: str | None) -> ArchSpec:
    """The ArchSpec for a config's model_type and/or the `--arch` flag."""
    if model_type in QK_NORM_MODEL_TYPES:
        raise ConvertError(
            f"config.json model_type={model_type!r} normalises q and k per head (qk-norm), which no linear "
            "MLA latent can reproduce; qk-norm models are not supported"
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
            "no config.json beside the checkpoint and no --arch: pass --arch "
            f"({', '.join(ARCHS)}) and the head counts (--n-heads, --n-kv-heads)"
        )
    return by_type or ARCHS[requested]
