"""Resolve the attention geometry of a checkpoint: config.json, flags, shapes.

Flags may fill what a bare file lacks and must not contradict config.json; the
tensor shapes must agree with both. Every refusal names the field or tensor
and says what to do.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from convert.arch.registry import ArchSpec, find_arch
from convert.errors import ConvertError
from convert.linalg.heads import HEAD_MAPS


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

    def prefix(self, layer: int) -> str:
        """Name prefix of layer `layer`'s attention tensors."""
        return self.layer_prefix_template.format(i=layer)

    def tensor(self, layer: int, proj: str, kind: str = "weight") -> str:
        return self.arch.tensor(self.prefix(layer), proj, kind)


def _flag_or_config(config: dict, field: str, flag: str, value: int | None) -> int | None:
    """The config's value, checked against the flag's when both are given."""
    in_config = config.get(field)
    if in_config is not None and value is not None and int(in_config) != int(value):
        raise ConvertError(
            f"{flag} {value} contradicts config.json {field}={in_config}; drop the flag or fix config.json"
        )
    return in_config if in_config is not None else value


def _layer_template(arch: ArchSpec, keys: set[str]) -> tuple[str, int]:
    """The first prefix template whose layer-0 query weight exists, and the layer count."""
    for template in arch.layer_prefixes:
        if arch.tensor(template.format(i=0), "q") in keys:
            if "{i}" not in template:
                return template, 1
            n = 0
            while arch.tensor(template.format(i=n), "q") in keys:
                n += 1
            return template, n
    expected = arch.tensor(arch.layer_prefixes[0].format(i=0), "q")
    raise ConvertError(f"no attention tensors of a {arch.name} model found (looked for {expected!r}); check --arch")


def _refuse_qk_norm(keys: Iterable[str]) -> None:
    normed = sorted(k for k in keys if k.endswith(("q_norm.weight", "k_norm.weight")))
    if normed:
        raise ConvertError(
            f"tensor {normed[0]!r} is a per-head qk-norm, a nonlinearity on W^K y that no linear MLA latent "
            "reproduces; qk-norm models are not supported"
        )


def _check_rope_config(config: dict) -> None:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConvertError(f"config.json partial_rotary_factor={factor}: partial RoPE is not supported yet")
    for field in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if config.get(field) is not None:
            raise ConvertError(f"config.json {field}={config[field]} is not supported for this architecture")


def resolve_attention(
    config: dict | None,
    keys: Iterable[str],
    shape: Callable[[str], tuple[int, ...]],
    *,
    arch: str | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    head_map: str | None = None,
) -> AttentionSpec:
    """Work out and check the attention geometry of a checkpoint.

    config: parsed config.json or None (a bare file: flags must give the heads).
    keys/shape: the checkpoint's tensor names and a shape lookup.
    """
    config = config or {}
    keys = set(keys)
    spec = find_arch(config.get("model_type"), arch)
    _refuse_qk_norm(keys)
    template, n_layers = _layer_template(spec, keys)
    n_layers = _flag_or_config(config, "num_hidden_layers", "layers", None) or n_layers
    prefix0 = template.format(i=0)
    q_rows, hidden = shape(spec.tensor(prefix0, "q"))
    k_name = spec.tensor(prefix0, "k")
    if k_name not in keys:
        raise ConvertError(f"layer 0 has no {k_name!r}; the checkpoint is incomplete or not a {spec.name} model")
    k_rows = shape(k_name)[0]

    n_heads = _flag_or_config(config, "num_attention_heads", "--n-heads", n_heads)
    if n_heads is None:
        raise ConvertError("the number of query heads is unknown (no config.json): pass --n-heads")
    head_dim = _flag_or_config(config, "head_dim", "--head-dim", head_dim) or q_rows // n_heads
    n_kv_heads = _flag_or_config(config, "num_key_value_heads", "--n-kv-heads", n_kv_heads)
    n_kv_heads = n_kv_heads or k_rows // head_dim
    hidden_size = config.get("hidden_size", hidden)
    _check_geometry(spec, prefix0, n_heads, n_kv_heads, head_dim, hidden_size, q_rows, k_rows, hidden)

    head_map = head_map or spec.head_map
    if head_map not in HEAD_MAPS:
        raise ConvertError(f"--head-map {head_map!r} is unknown; use one of {', '.join(HEAD_MAPS)}")
    if spec.rope:
        _check_rope_config(config)
        if head_dim % 2:
            raise ConvertError(f"head_dim={head_dim} is odd: RoPE needs pairs of dims; check config.json head_dim")
    return AttentionSpec(
        arch=spec,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        head_map=head_map,
        rope=spec.rope is not None,
        softmax_scale=head_dim**-0.5,
        layer_prefix_template=template,
    )


def _check_geometry(spec, prefix, n_heads, n_kv_heads, head_dim, hidden_size, q_rows, k_rows, hidden) -> None:
    if n_heads <= 0 or n_kv_heads <= 0 or head_dim <= 0:
        raise ConvertError(
            f"head counts must be positive (n_heads={n_heads}, n_kv_heads={n_kv_heads}, head_dim={head_dim})"
        )
    if n_heads % n_kv_heads:
        raise ConvertError(
            f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: every key/value head must serve "
            "the same number of query heads; check num_attention_heads / num_key_value_heads"
        )
    q_name, k_name = spec.tensor(prefix, "q"), spec.tensor(prefix, "k")
    if q_rows != n_heads * head_dim:
        raise ConvertError(
            f"{q_name} has {q_rows} rows but n_heads×head_dim = {n_heads}×{head_dim} = {n_heads * head_dim}; "
            "config.json (or the flags) do not describe this checkpoint"
        )
    if k_rows != n_kv_heads * head_dim:
        raise ConvertError(
            f"{k_name} has {k_rows} rows but n_kv_heads×head_dim = {n_kv_heads}×{head_dim} = {n_kv_heads * head_dim}; "
            "config.json (or the flags) do not describe this checkpoint"
        )
    if hidden != hidden_size:
        raise ConvertError(f"{q_name} has {hidden} columns but config.json hidden_size={hidden_size}; fix config.json")
