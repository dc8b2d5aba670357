"""Compression below the exact rank: calibration, weighting, budget allocation (docs/design.md, "Compression").

`uniform_ranks` and `allocate_global` decide the latent sizes for a KV-cache budget (the budget
itself is `convert.plan`'s); the conversion then factors each layer with `layer_weighting`'s
weights at those ranks (see `convert.transform.factor_layer`). The statistics behind the weights
come from `calibrate` and `fisher_calibrate(_streamed)`, or from `convert.compress.sequential`.
"""

import torch

from convert.arch import AttentionSpec
from convert.compress.allocate import Latent, allocate_global
from convert.compress.calibrate import LayerStats, calibrate, fisher_calibrate, fisher_calibrate_streamed
from convert.compress.weights import Weighting, layer_weighting
from convert.linalg.weighted import decoupled_spectrum, pair_weighted_moment_spectrum, weighted_spectrum
from convert.options import METHODS
from convert.transform import LayerWeights, with_bias

__all__ = [
    "METHODS",
    "LayerStats",
    "Weighting",
    "calibrate",
    "fisher_calibrate",
    "fisher_calibrate_streamed",
    "layer_weighting",
    "allocate_global",
    "layer_latents",
    "uniform_ranks",
]


def layer_latents(
    layer: int, w: LayerWeights, spec: AttentionSpec, layout: str, weighting: Weighting | None
) -> list[Latent]:
    """The key and value latents of one layer with their weighted spectra."""
    weighting = weighting or Weighting()
    affine = spec.rope and w.k_bias is not None
    keys = with_bias(w.k, w.k_bias if affine else None)
    if spec.qk_norm is not None:  # the normed keys n themselves: the identity on n, weighted
        keys = torch.eye(spec.n_kv_heads * spec.head_dim, dtype=torch.float64)
    if spec.rope and layout == "absorbed" and spec.static_freqs:  # [rotary pairs | static NoPE dims]
        s = decoupled_spectrum(
            keys,
            spec.n_kv_heads,
            spec.static_freqs,
            weighting.key_pairs,
            weighting.key_moment,
            weighting.key_static_rows,
        )
        key = Latent(layer, "rank_k", s, cost=1)
    elif spec.rope and layout == "absorbed":
        s = pair_weighted_moment_spectrum(keys, spec.n_kv_heads, weighting.key_pairs, weighting.key_moment)
        key = Latent(layer, "rank_k", s.reshape(-1).sort(descending=True).values, cost=2)
    else:
        key = Latent(layer, "rank_k", weighted_spectrum(keys, weighting.key_rows, weighting.key_moment), cost=1)
    value = Latent(layer, "rank_v", weighted_spectrum(w.v, weighting.value_rows, weighting.value_moment), cost=1)
    return [key, value]


def uniform_ranks(spec: AttentionSpec, layout: str, per_layer: int) -> dict:
    """The ranks of one layer caching `per_layer` dims per token: half keys, half values
    (keys rounded down to whole RoPE pairs in the absorbed layout)."""
    rank_k = per_layer // 2
    if spec.rope and layout == "absorbed" and not spec.static_freqs:
        rank_k -= rank_k % 2
    return {"rank_k": rank_k, "rank_v": per_layer - rank_k}
