"""The pure state-dict transform: one layer's GQA attention tensors -> MLA tensors (`convert_layer`).

No files and no modules here: tensors in, tensors out. Output names are relative to the layer's attention prefix and
match the submodules of `convert.mla.MLAAttention`; docs/design.md, "Output format", lists them per layout.
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from convert.arch import AttentionSpec
from convert.linalg import (
    Factor,
    absorb_output,
    absorb_query,
    aligned_rope_factor,
    expand_groups,
    joint_factor,
    partial_rope_factor,
    real_factor,
    rope_factor,
    work_dtype,
)
from convert.linalg.weighted import decoupled_rope_factor, weighted_factor, weighted_rope_factor


@dataclass
class LayerWeights:
    """One layer's attention in the source checkpoint (biases optional)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # RMSNorm weights: (d,) per head (Qwen3, Gemma 3), or (H·d,) / (G·d,) (OLMo 2)
    k_norm: torch.Tensor | None = None


@dataclass
class LayerInfo:
    """What the conversion of one layer did: ranks, energy, factor error, notes."""

    ranks: dict[str, int]
    retained_energy: dict[str, float]
    factor_error: dict[str, float]
    key_freq_index: list[int] | None = None
    notes: list[str] = field(default_factory=list)

    def to_config(self) -> dict:
        """The layer's entry in config.json's `mla.layers`."""
        entry: dict = dict(self.ranks)
        entry["retained_energy"] = self.retained_energy
        entry["factor_error"] = self.factor_error
        if self.key_freq_index is not None:
            entry["key_freq_index"] = self.key_freq_index
        return entry


@dataclass(frozen=True)
class LayerFactors:
    """One layer's keys and values factored (`factor_layer`): the key factor (joint: of [W^K; W^V]),
    the value factor, whether the key latent is affine (key bias kept), and notes for the report."""

    key: Factor
    value: Factor
    affine: bool
    notes: list[str]


def with_bias(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(m, D) weight and (m,) bias -> (m, D+1) in `dtype`: the affine map as a linear one on [y; 1]."""
    if bias is None:
        return weight.to(dtype)
    return torch.cat([weight.to(dtype), bias.to(dtype)[:, None]], dim=1)


def _split_bias(aug: torch.Tensor, has_bias: bool, name: str) -> dict[str, torch.Tensor]:
    """Inverse of `with_bias` into `{name}.weight` / `{name}.bias` entries."""
    if not has_bias:
        return {f"{name}.weight": aug}
    return {f"{name}.weight": aug[:, :-1], f"{name}.bias": aug[:, -1]}


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖ / ‖exact‖ in approx's precision (the factorization's)."""
    exact = exact.to(approx.dtype)
    norm = exact.norm()
    return float((approx - exact).norm() / norm) if norm > 0 else float((approx - exact).norm())


def _key_factor(
    w: LayerWeights, spec: AttentionSpec, layout: str, rank: int | None, weighting, work: torch.dtype
) -> tuple[Factor, bool]:
    """Factor the keys; returns the factor and whether its latent is affine (key bias kept).
    work: precision of the plain factorizations (`work_dtype`); the others run in float64."""
    affine = spec.rope and w.k_bias is not None
    keys = with_bias(w.k, w.k_bias if affine else None, work)  # (G·d, D[+1])
    if spec.qk_norm is not None:  # blocks per KV head; compressed: `normed_key_factor` after the norm
        return aligned_rope_factor(keys, spec.n_kv_heads), affine
    per_frequency = spec.rope and layout == "absorbed"
    if per_frequency and spec.rotary_dim is not None:  # exact only (plan refuses a lower rank)
        return partial_rope_factor(keys, spec.n_kv_heads, spec.rotary_dim), affine
    if per_frequency and spec.static_freqs:  # compressed: [rotary pairs | static frequencies as NoPE]
        assert rank is not None  # static frequencies are set only when compressing, at planned ranks
        return decoupled_rope_factor(keys, spec.n_kv_heads, rank, spec.static_freqs, weighting), affine
    if weighting is not None:
        if per_frequency:
            assert rank is not None  # a weighting comes only with compression, at planned ranks
            pairs, moment, cross = weighting.key_pairs, weighting.key_moment, weighting.key_cross
            return weighted_rope_factor(keys, spec.n_kv_heads, rank, pairs, moment, cross), affine
        return weighted_factor(keys, rank, weighting.key_rows, weighting.key_moment, weighting.key_cross), affine
    if per_frequency:
        return rope_factor(keys, spec.n_kv_heads, rank, work), affine
    return real_factor(keys, rank, work), affine


def normed_key_factor(spec: AttentionSpec, rank: int, weighting) -> Factor:
    """q/k norm, compressed: the normed keys n (G·d, source head order) cached through a
    rank-`rank` projection, n ≈ up · down · n, weighted as the calibration says (`weighting`'s
    key moment E[n nᵀ] and rows). The norm itself stays exact: it runs on the whole aligned
    latent before `down` (the `k_compress` tensor)."""
    eye = torch.eye(spec.n_kv_heads * spec.head_dim, dtype=torch.float64)
    return weighted_factor(eye, rank, weighting.key_rows, weighting.key_moment, weighting.key_cross)


def _value_factor(w: LayerWeights, rank: int | None, weighting, work: torch.dtype) -> Factor:
    if weighting is not None:
        return weighted_factor(w.v, rank, weighting.value_rows, weighting.value_moment, weighting.value_cross)
    return real_factor(w.v, rank, work)


def factor_layer(
    w: LayerWeights,
    spec: AttentionSpec,
    latent: str,
    layout: str,
    ranks: dict | None,
    weighting=None,
    work: torch.dtype = torch.float64,
) -> LayerFactors:
    """Factor one layer's keys and values.

    ranks: {"rank_k", "rank_v"} or {"rank_kv"}; None = exact. weighting: a
    `convert.compress.Weighting` for compression below the exact rank, or None
    (plain SVD, exact at full rank). work: precision of the plain SVDs (`work_dtype`).
    """
    ranks = ranks or {}
    notes = []
    if w.k_bias is not None and not spec.rope:
        notes.append("k bias dropped: without RoPE q·b_K is constant over keys and cancels in softmax")
    if latent == "joint":
        key_f, value_f = joint_factor(w.k, w.v, ranks.get("rank_kv"), work)
        return LayerFactors(key_f, value_f, False, notes)
    key_f, affine = _key_factor(w, spec, layout, ranks.get("rank_k"), weighting, work)
    return LayerFactors(key_f, _value_factor(w, ranks.get("rank_v"), weighting, work), affine, notes)


def convert_layer(
    w: LayerWeights,
    spec: AttentionSpec,
    latent: str,
    layout: str,
    ranks: dict | None = None,
    weighting=None,
    dtype: torch.dtype = torch.float64,
):
    """Convert one layer. Returns (tensors by relative name, LayerInfo).

    dtype: of the absorbed Ŵ^Q and Ŵ^O (computed head by head, cast as stored: the checkpoint's
    dtype keeps a large model's layer small). The plain factorizations and the products run in
    `work_dtype(dtype)`: float64, float32 when `dtype` is half precision. The other tensors come
    in that precision (float64 from compression), but the factored layout's W^Q and W^O, which
    are the source's own.
    """
    work = work_dtype(dtype)
    factors = factor_layer(w, spec, latent, layout, ranks, weighting, work)
    out = _down_tensors(factors, latent)
    normed = None  # q/k norm, compressed: the factor of the normed keys
    rank_k = (ranks or {}).get("rank_k", factors.key.rank)
    if spec.qk_norm is not None and rank_k < factors.key.rank:
        normed = normed_key_factor(spec, rank_k, weighting)
        out["k_compress.weight"] = normed.down @ factors.key.up  # (r_K, G·d): from the aligned latent
        factors = dataclasses.replace(factors, key=normed)  # what the cache holds of the keys: reported
    up_k = expand_groups(factors.key.up, spec.n_heads, spec.n_kv_heads, spec.head_map)  # (H·d, r_K)
    up_v = expand_groups(factors.value.up, spec.n_heads, spec.n_kv_heads, spec.head_map)  # (H·d, r_V)
    out_bias = _output_bias(w, spec)
    if spec.qk_norm is not None:
        assert w.q_norm is not None and w.k_norm is not None  # read with the layer when the spec has q/k norm
        out |= _split_bias(with_bias(w.q, w.q_bias), w.q_bias is not None, "q_proj")
        out |= {"q_norm.weight": w.q_norm.double(), "k_norm.weight": w.k_norm.double(), "k_up.weight": up_k}
        o_name = "o_absorbed" if layout == "absorbed" else "o_proj"
        if layout == "absorbed":
            out["o_absorbed.weight"] = absorb_output(w.o, up_v, spec.n_heads, dtype)  # (D, H·r_V)
        else:
            out |= {"v_up.weight": up_v, "o_proj.weight": w.o.double()}
        out |= {f"{o_name}.bias": out_bias} if out_bias is not None else {}
    elif layout == "absorbed":
        q_hat = absorb_query(with_bias(w.q, w.q_bias, work), up_k, spec.n_heads, dtype)  # (H·r_K, D[+1])
        out |= _split_bias(q_hat, w.q_bias is not None, "q_absorbed")
        out["o_absorbed.weight"] = absorb_output(w.o, up_v, spec.n_heads, dtype)  # (D, H·r_V)
        out |= {"o_absorbed.bias": out_bias} if out_bias is not None else {}
    else:  # W^Q and W^O as they are (the caller's cast to the checkpoint's dtype is then a no-op)
        out |= {"q_proj.weight": w.q} | ({"q_proj.bias": w.q_bias} if w.q_bias is not None else {})
        out |= {"k_up.weight": up_k, "v_up.weight": up_v, "o_proj.weight": w.o}
        out |= {"o_proj.bias": out_bias} if out_bias is not None else {}
    key_target = None if normed is None else torch.eye(normed.up.shape[0], dtype=normed.up.dtype)
    return out, _layer_info(w, factors, latent, layout, key_target)


def _down_tensors(factors: LayerFactors, latent: str) -> dict[str, torch.Tensor]:
    if latent == "joint":
        return {"kv_down.weight": factors.key.down}
    return _split_bias(factors.key.down, factors.affine, "k_down") | {"v_down.weight": factors.value.down}


def _output_bias(w: LayerWeights, spec: AttentionSpec) -> torch.Tensor | None:
    """b_O plus W_O·tile(b_V): since Σα = 1 the value bias leaves attention unchanged."""
    bias = None if w.o_bias is None else w.o_bias.double()
    if w.v_bias is not None:
        tiled = expand_groups(w.v_bias.double()[:, None], spec.n_heads, spec.n_kv_heads, spec.head_map)  # (H·d, 1)
        from_v = (w.o.double() @ tiled)[:, 0]  # (D,)
        bias = from_v if bias is None else bias + from_v
    return bias


def _layer_info(w: LayerWeights, factors: LayerFactors, latent: str, layout: str, key_target=None) -> LayerInfo:
    """key_target: what the key factor's up @ down approximates (default the key projection; the
    identity on the normed keys for a compressed q/k norm)."""
    key_f, value_f = factors.key, factors.value
    keys = with_bias(w.k, w.k_bias if factors.affine else None) if key_target is None else key_target
    if latent == "joint":
        ranks = {"rank_kv": key_f.rank}
        energy = {"kv": key_f.retained_energy()}
        stacked = torch.cat([w.k, w.v])
        errors = {"kv": _relative_error(torch.cat([key_f.up, value_f.up]) @ key_f.down, stacked)}
    else:
        ranks = {"rank_k": key_f.rank, "rank_v": value_f.rank}
        energy = {"k": key_f.retained_energy(), "v": value_f.retained_energy()}
        errors = {
            "k": _relative_error(key_f.up @ key_f.down, keys),
            "v": _relative_error(value_f.up @ value_f.down, w.v),
        }
    freq = key_f.freq_index.tolist() if key_f.freq_index is not None and layout == "absorbed" else None
    return LayerInfo(ranks=ranks, retained_energy=energy, factor_error=errors, key_freq_index=freq, notes=factors.notes)
