"""Compression below the exact rank: calibration, weighting, budget allocation (DESIGN §6).

`plan_ranks` decides every layer's latent sizes for a KV-cache budget; the
conversion then factors each layer with `layer_weighting`'s weights at those
ranks (see `convert.transform.factor_layer`).
"""

from convert.arch import AttentionSpec
from convert.compress.allocate import Latent, allocate_global, budget_dims
from convert.compress.calibrate import LayerStats, calibrate, fisher_calibrate
from convert.compress.weights import METHODS, Weighting, layer_weighting
from convert.linalg.weighted import pair_weighted_moment_spectrum, weighted_spectrum
from convert.transform import LayerWeights, with_bias

__all__ = [
    "METHODS",
    "LayerStats",
    "Weighting",
    "calibrate",
    "fisher_calibrate",
    "layer_weighting",
    "layer_latents",
    "plan_ranks",
    "uniform_ranks",
]


def layer_latents(
    layer: int, w: LayerWeights, spec: AttentionSpec, layout: str, weighting: Weighting | None
) -> list[Latent]:
    """The key and value latents of one layer with their weighted spectra."""
    weighting = weighting or Weighting()
    affine = spec.rope and w.k_bias is not None
    keys = with_bias(w.k, w.k_bias if affine else None)
    if spec.rope and layout == "absorbed":
        s = pair_weighted_moment_spectrum(keys, spec.n_kv_heads, weighting.key_pairs, weighting.key_moment)
        key = Latent(layer, "rank_k", s.reshape(-1).sort(descending=True).values, cost=2)
    else:
        key = Latent(layer, "rank_k", weighted_spectrum(keys, weighting.key_rows, weighting.key_moment), cost=1)
    value = Latent(layer, "rank_v", weighted_spectrum(w.v, weighting.value_rows, weighting.value_moment), cost=1)
    return [key, value]


def uniform_ranks(spec: AttentionSpec, layout: str, ratio: float) -> dict:
    """The same ranks in every layer, meeting round(ratio · 2·G·d) cache dims per layer exactly."""
    per_layer = round(ratio * 2 * spec.n_kv_heads * spec.head_dim)
    rank_k = per_layer // 2
    if spec.rope and layout == "absorbed":
        rank_k -= rank_k % 2  # whole RoPE pairs
    return {"rank_k": rank_k, "rank_v": per_layer - rank_k}


def plan_ranks(
    latents: list[Latent], spec: AttentionSpec, layout: str, ratio: float, allocation: str, method: str
) -> list[dict]:
    """Per-layer ranks for a cache `ratio` of GQA's: uniform, or global by weighted energy."""
    if allocation == "uniform":
        return [uniform_ranks(spec, layout, ratio) for _ in range(spec.n_layers)]
    budget = budget_dims(ratio, spec.n_layers, spec.n_kv_heads, spec.head_dim)
    return allocate_global(latents, budget, normalize=method != "fisher")
