"""Resolve the attention geometry of a checkpoint: config.json, flags, shapes.

Flags may fill what a bare file lacks and must not contradict config.json; the
tensor shapes must agree with both. Every refusal names the field or tensor
and says what to do.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from convert.arch.registry import HEAD_MAPS, ArchSpec, TensorRule, find_arch, tied_embeddings
from convert.arch.validate import check_config
from convert.errors import ConvertError
from convert.rope.config import parameter_sets


@dataclass(frozen=True)
class AttentionSpec:
    """The attention of one model: the same geometry in every layer."""

    arch: ArchSpec
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    head_map: str
    rope: bool
    softmax_scale: float
    layer_prefix_template: str
    qk_norm: str | None = None  # "head": q and k RMS-normalised per head before RoPE (Qwen3)
    norm_eps: float | None = None  # the q/k norms' epsilon (rms_norm_eps)
    softcap: float | None = None  # scores -> cap·tanh(scores/cap) before the mask (Gemma 2)
    rotary_dim: int | None = None  # partial RoPE: the first rotary_dim dims of each head rotate (None: all)
    static_freqs: tuple[int, ...] = ()  # absorbed compression: frequencies cached as NoPE (`--nope-angle`)

    def prefix(self, layer: int) -> str:
        """Name prefix of layer `layer`'s attention tensors."""
        return self.layer_prefix_template.format(i=layer)

    def tensor(self, layer: int, proj: str, kind: str = "weight") -> str:
        return self.arch.tensor(self.prefix(layer), proj, kind)

    def other_tensors(self, layer: int | None) -> list[str]:
        """The family's non-attention tensors of `layer` (None: the model-level ones: embedding, norm, lm_head)."""
        rules = [r.name for r in self.arch.tensors if ("{i}" in r.name) == (layer is not None)]
        return [name.format(i=layer) for name in rules]


@dataclass(frozen=True)
class GeometryFlags:
    """The geometry flags of a conversion (--arch, --n-heads, --n-kv-heads, --head-dim, --head-map):
    None where not given, so config.json, the family or the tensor shapes decide."""

    arch: str | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    head_map: str | None = None


@dataclass(frozen=True)
class _FirstLayer:
    """Layer 0's query and key weights as stored: what the head geometry must agree with."""

    q_name: str
    k_name: str
    q_rows: int
    k_rows: int
    hidden: int  # the query weight's columns


def _first_layer(arch: ArchSpec, prefix: str, keys: set[str], shape) -> _FirstLayer:
    q_name, k_name = arch.tensor(prefix, "q"), arch.tensor(prefix, "k")
    q_rows, hidden = _matrix(q_name, shape)
    if k_name not in keys:
        raise ConvertError(f"layer 0 has no {k_name!r}; the checkpoint is incomplete or not a {arch.name} model")
    return _FirstLayer(q_name, k_name, q_rows, _matrix(k_name, shape)[0], hidden)


def _flag_or_config(config: dict, field: str, flag: str, value: int | None) -> int | None:
    """The config's value, checked against the flag's when both are given."""
    in_config = config.get(field)
    if in_config is not None and value is not None and int(in_config) != int(value):
        raise ConvertError(
            f"{flag} {value} contradicts config.json {field}={in_config}; drop the flag or fix config.json"
        )
    return in_config if in_config is not None else value


def _layer_template(arch: ArchSpec, keys: set[str]) -> str:
    """The first prefix template whose layer-0 query weight exists."""
    for template in arch.layer_prefixes:
        if arch.tensor(template.format(i=0), "q") in keys:
            return template
    expected = arch.tensor(arch.layer_prefixes[0].format(i=0), "q")
    raise ConvertError(
        f"no attention tensors of a {arch.name} model found (looked for {expected!r}); the checkpoint is "
        "incomplete, or not this architecture: check --arch or config.json model_type"
    )


def count_layers(arch: ArchSpec, template: str, keys: set[str]) -> int:
    """Layers present: every index 0…n-1 holds tensors, none beyond; a gap is refused."""
    if "{i}" not in template:
        return 1
    pattern = re.compile(arch.layer_pattern)
    indices = set()
    for name in keys:
        match = pattern.match(name)
        if match and len(match.group(1)) > 9:
            raise ConvertError(f"tensor {name[:120]!r} has a layer index no model reaches; the checkpoint is corrupt")
        if match:
            indices.add(int(match.group(1)))
    gaps = sorted(set(range(max(indices, default=-1) + 1)) - indices)
    if gaps:
        raise ConvertError(
            f"the checkpoint has tensors of layer {max(indices)} but none of layer {gaps[0]} "
            f"({template.format(i=gaps[0])}…); it is incomplete: re-download or re-export it"
        )
    return len(indices)


def _check_layer_count(config: dict, n_layers: int) -> None:
    """config.json's num_hidden_layers must be the number of layers the checkpoint holds."""
    declared = config.get("num_hidden_layers")
    if declared is not None and declared != n_layers:
        raise ConvertError(
            f"config.json num_hidden_layers={declared} but the checkpoint holds {n_layers} layers; fix "
            "num_hidden_layers, or re-download the checkpoint if layers are missing"
        )


def _matrix(name: str, shape: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
    """(rows, columns) of a weight that must be a matrix."""
    dims = tuple(shape(name))
    if len(dims) != 2:
        raise ConvertError(
            f"{name} has shape {list(dims)}, not a matrix [out, in]; the checkpoint is corrupt: re-export it"
        )
    return dims


def _refuse_qk_norm(arch: ArchSpec, keys: Iterable[str]) -> None:
    normed = sorted(k for k in keys if k.endswith(("q_norm.weight", "k_norm.weight")))
    if normed and arch.qk_norm is None:
        raise ConvertError(
            f"tensor {normed[0]!r} is a q/k norm, which a {arch.name} model does not have; the checkpoint is "
            "not this architecture: fix config.json model_type (qwen3 for per-head q/k norms)"
        )


def _check_rope_config(config: dict, arch: ArchSpec, head_dim: int) -> int | None:
    """Refuse what the RoPE config asks that convert does not do; returns the rotary dims per head
    when only part of each head rotates (a family with partial RoPE), else None."""
    factors: list[tuple[str, Any]] = [("partial_rotary_factor", config.get("partial_rotary_factor"))]  # config.json's
    factors += [
        (f"{field}.partial_rotary_factor", p.get("partial_rotary_factor")) for field, p in parameter_sets(config)
    ]
    factors = [(field, factor) for field, factor in factors if factor is not None and factor != 1.0]
    rotary_dim = None
    for field, factor in factors:
        if not arch.partial_rotary:
            raise ConvertError(
                f"config.json {field}={factor}: partial RoPE, which transformers' {arch.name} attention does not "
                "apply (it rotates every dim); fix config.json, or set model_type to the family it comes from"
            )
        dims = int(head_dim * factor)
        if rotary_dim is not None and dims != rotary_dim:
            raise ConvertError(f"config.json {field}={factor} contradicts another partial_rotary_factor; keep one")
        if dims <= 0 or dims % 2 or dims > head_dim:
            raise ConvertError(
                f"config.json {field}={factor} rotates {dims} of head_dim={head_dim} dims; RoPE needs an even "
                "number of dims between 2 and head_dim: fix partial_rotary_factor"
            )
        rotary_dim = dims
    for field in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if config.get(field) is not None and not arch.gemma_scores:
            raise ConvertError(f"config.json {field}={config[field]} is not supported for this architecture")
    if config.get("use_bidirectional_attention"):
        raise ConvertError(
            "config.json use_bidirectional_attention=true: convert writes causal attention only; "
            "set it to false if the model is a causal LM"
        )
    return rotary_dim


def _query_heads(config: dict, flags: GeometryFlags) -> int:
    """The number of query heads: config.json's, or --n-heads for a bare file."""
    n_heads = _flag_or_config(config, "num_attention_heads", "--n-heads", flags.n_heads)
    if n_heads is None:
        raise ConvertError("the number of query heads is unknown (no config.json): pass --n-heads")
    if n_heads <= 0:
        raise ConvertError(f"--n-heads {n_heads} is not a positive number of query heads; pass the model's head count")
    return n_heads


def _rotary_dim(spec: ArchSpec, config: dict, head_dim: int) -> int | None:
    """The rotated dims per head of a RoPE model (its config's partial rotary factor), checked; None without RoPE."""
    if not spec.rope:
        return None
    rotary_dim = _check_rope_config(config, spec, head_dim)
    if head_dim % 2:
        raise ConvertError(f"head_dim={head_dim} is odd: RoPE needs pairs of dims; check config.json head_dim")
    return rotary_dim


def resolve_attention(
    config: dict | None,
    keys: Iterable[str],
    shape: Callable[[str], tuple[int, ...]],
    flags: GeometryFlags = GeometryFlags(),
) -> AttentionSpec:
    """Work out and check the attention geometry of a checkpoint.

    config: parsed config.json or None (a bare file: flags must give the heads).
    keys/shape: the checkpoint's tensor names and a shape lookup.
    """
    config = config or {}
    check_config(config)
    keys = set(keys)
    spec = find_arch(config.get("model_type"), flags.arch, config)
    if _is_hf_config(spec, config):
        _require_fields(spec, config)
    _refuse_qk_norm(spec, keys)
    template = _layer_template(spec, keys)
    n_layers = count_layers(spec, template, keys)
    _check_layer_count(config, n_layers)
    first = _first_layer(spec, template.format(i=0), keys, shape)

    n_heads = _query_heads(config, flags)
    hidden_size = config.get("hidden_size", first.hidden)
    head_dim = _flag_or_config(config, "head_dim", "--head-dim", flags.head_dim) or _default_head_dim(
        spec, config, hidden_size, first.q_rows, n_heads
    )
    n_kv_heads = _flag_or_config(config, "num_key_value_heads", "--n-kv-heads", flags.n_kv_heads)
    n_kv_heads = n_kv_heads or (n_heads if _is_hf_config(spec, config) else first.k_rows // head_dim)
    _check_geometry(first, n_heads, n_kv_heads, head_dim, hidden_size)
    if _is_hf_config(spec, config):
        _check_model_tensors(spec, config, hidden_size, n_layers, keys, shape)

    head_map = flags.head_map or spec.head_map
    if head_map not in HEAD_MAPS:
        raise ConvertError(f"--head-map {head_map!r} is unknown; use one of {', '.join(HEAD_MAPS)}")
    rotary_dim = _rotary_dim(spec, config, head_dim)
    return AttentionSpec(
        arch=spec,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        head_map=head_map,
        rope=spec.rope is not None,
        softmax_scale=_softmax_scale(spec, config, head_dim),
        layer_prefix_template=template,
        qk_norm=spec.qk_norm,
        norm_eps=_norm_eps(spec, config),
        softcap=config.get("attn_logit_softcapping") if spec.gemma_scores else None,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
    )


def _softmax_scale(arch: ArchSpec, config: dict, head_dim: int) -> float:
    """1/√d, or Gemma's `query_pre_attn_scalar`^-1/2 (never guessed: a Gemma config must give it)."""
    if not arch.gemma_scores:
        return head_dim**-0.5
    if config.get("query_pre_attn_scalar") is None:
        raise ConvertError(
            f"config.json has no query_pre_attn_scalar, which sets a {arch.name} model's softmax scale; add the "
            "model's value (its Hugging Face config.json has it)"
        )
    return float(config["query_pre_attn_scalar"]) ** -0.5


def _norm_eps(arch: ArchSpec, config: dict) -> float | None:
    """The q/k norms' epsilon, from config.json (never guessed); None without q/k norm."""
    if arch.qk_norm is None:
        return None
    if config.get("rms_norm_eps") is None:
        raise ConvertError(
            f"config.json has no rms_norm_eps, the epsilon of a {arch.name} model's q/k norms; add the model's "
            "rms_norm_eps (or convert its Hugging Face directory, whose config.json has it)"
        )
    return float(config["rms_norm_eps"])


def _is_hf_config(arch: ArchSpec, config: dict) -> bool:
    """Whether `config` is a transformers family's config.json (not a bare file's flags)."""
    return arch.hf_attention is not None and config.get("model_type") is not None


#: Fields whose absence transformers fills with a default of its own (e.g. 32 layers, 4096 hidden),
#: not this checkpoint's: a config.json of a transformers family must give them.
REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def _require_fields(arch: ArchSpec, config: dict) -> None:
    missing = [f for f in REQUIRED_FIELDS if config.get(f) is None]
    if missing:
        raise ConvertError(
            f"config.json has no {missing[0]}; transformers would build a {arch.name} model with its default "
            f"{missing[0]}, not this checkpoint's: add the model's {missing[0]}"
        )


def _default_head_dim(arch: ArchSpec, config: dict, hidden_size: int, q_rows: int, n_heads: int) -> int:
    """head_dim when neither config.json nor a flag gives it: transformers' rule for its families
    (hidden_size // num_attention_heads), else what the query weight's rows imply."""
    return hidden_size // n_heads if _is_hf_config(arch, config) else q_rows // n_heads


def _presence(rule: TensorRule, config: dict) -> tuple[bool, bool]:
    """(required, allowed) of a rule's tensor under this config."""
    if rule.when in ("always", "never"):
        return rule.when == "always", rule.when == "always"
    if rule.when == "untied":
        return not tied_embeddings(config), True
    return bool(config.get(rule.when, False)), bool(config.get(rule.when, False))


def _check_model_tensors(arch: ArchSpec, config: dict, hidden_size: int, n_layers: int, keys: set[str], shape) -> None:
    """The family's other tensors (embedding, norms, MLP, lm_head, attention biases): present exactly
    when config.json says the model has them, with the shapes its fields give."""
    dims = {
        "hidden_size": hidden_size,
        **{f: config.get(f) for f in ("vocab_size", "intermediate_size", "num_local_experts")},
    }
    dims["gate_up_size"] = 2 * dims["intermediate_size"] if dims["intermediate_size"] is not None else None
    for rule in arch.tensors:
        required, allowed = _presence(rule, config)
        layers = range(n_layers) if "{i}" in rule.name else [None]
        for name in (rule.name.format(i=i) for i in layers):
            if name in keys and not allowed:
                raise ConvertError(
                    f"the checkpoint has {name} but config.json says a {arch.name} model without it "
                    f"({_why_absent(rule)}); fix config.json or remove the tensor"
                )
            if required and name not in keys:
                raise ConvertError(
                    f"the checkpoint has no {name}, which config.json's {arch.name} model needs; "
                    "the checkpoint is incomplete: re-download or re-export it"
                )
            if name in keys and rule.shape is not None:
                _check_rule_shape(name, tuple(shape(name)), rule.shape, dims)


def _why_absent(rule: TensorRule) -> str:
    return "the family has no such parameter" if rule.when == "never" else f"{rule.when} is false or absent"


def _check_rule_shape(name: str, actual: tuple[int, ...], fields: tuple[str, ...], dims: dict) -> None:
    """A tensor's shape against the config fields that give it (a field the config lacks is not checked)."""
    expected = [dims[f] for f in fields]
    if len(actual) != len(expected) or any(e is not None and a != e for a, e in zip(actual, expected)):
        described = ", ".join(f"{f}={dims[f]}" for f in dict.fromkeys(fields))
        raise ConvertError(
            f"{name} has shape {list(actual)}, expected {[e if e is not None else '?' for e in expected]} "
            f"from config.json {described}; config.json does not describe this checkpoint"
        )


def _check_geometry(first: _FirstLayer, n_heads: int, n_kv_heads: int, head_dim: int, hidden_size: int) -> None:
    if n_heads <= 0 or n_kv_heads <= 0 or head_dim <= 0:
        raise ConvertError(
            f"head counts must be positive (n_heads={n_heads}, n_kv_heads={n_kv_heads}, head_dim={head_dim})"
        )
    if n_heads % n_kv_heads:
        raise ConvertError(
            f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: every key/value head must serve "
            "the same number of query heads; check num_attention_heads / num_key_value_heads"
        )
    q_name, k_name = first.q_name, first.k_name
    if first.q_rows != n_heads * head_dim:
        raise ConvertError(
            f"{q_name} has {first.q_rows} rows but n_heads×head_dim = {n_heads}×{head_dim} = {n_heads * head_dim}; "
            "config.json (or the flags) do not describe this checkpoint"
        )
    if first.k_rows != n_kv_heads * head_dim:
        raise ConvertError(
            f"{k_name} has {first.k_rows} rows but n_kv_heads×head_dim = {n_kv_heads}×{head_dim} = {n_kv_heads * head_dim}; "
            "config.json (or the flags) do not describe this checkpoint"
        )
    if first.hidden != hidden_size:
        raise ConvertError(
            f"{q_name} has {first.hidden} columns but config.json hidden_size={hidden_size}; fix config.json"
        )
