"""Compression below the exact rank: calibration, weighting, budget allocation (docs/design.md, "Compression").

Decides each latent's rank for a KV-cache budget (the budget itself is `convert.plan`'s) and what its error is weighted
by; the conversion then factors each layer at those ranks (`convert.transform.factor_layer`).
"""

import torch

from convert.arch import AttentionSpec
from convert.compress.allocate import Latent, allocate_global
from convert.compress.calibrate import (
    CalibrationRun,
    LayerStats,
    calibrate,
    fisher_calibrate,
    fisher_calibrate_streamed,
)
from convert.compress.weights import Weighting, layer_weighting
from convert.hf import hf_classes, hf_config
from convert.linalg.weighted import decoupled_spectrum, pair_weighted_moment_spectrum, weighted_spectrum
from convert.options import METHODS
from convert.transform import LayerWeights, with_bias

__all__ = [
    "METHODS",
    "CalibrationRun",
    "LayerStats",
    "Weighting",
    "calibrate",
    "fisher_calibrate",
    "fisher_calibrate_streamed",
    "layer_weighting",
    "allocate_global",
    "layer_latents",
    "uniform_ranks",
    "static_frequencies",
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
        s = decoupled_spectrum(keys, spec.n_kv_heads, spec.static_freqs, weighting)
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


#: The span over which a frequency must turn less than --nope-angle to be cached as NoPE.
STATIC_SPAN = 4096


def static_frequencies(spec: AttentionSpec, config: dict, angle: float) -> tuple[int, ...]:
    """The key frequencies j (pairs j, j + d/2) whose RoPE turns less than `angle` radians over
    min(max_position_embeddings, 4096) tokens: within that span they are nearly static, so an
    absorbed compressed latent caches them as NoPE dims (compressed across frequencies and heads)
    instead of spending a rotary pair per component. Computed from the source's own rotary
    embedding (rope_theta and scaling as transformers applies them)."""
    if spec.arch.hf_attention is None or config.get("model_type") is None:
        return ()

    rotary = hf_classes(spec.arch.name)[2](hf_config(config))
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:  # a rotary embedding per layer type (Gemma 3): keep every frequency rotary
        return ()
    return held_frequencies(inv_freq, min(config.get("max_position_embeddings") or STATIC_SPAN, STATIC_SPAN), angle)


def held_frequencies(inv_freq: torch.Tensor, span: int, angle: float) -> tuple[int, ...]:
    """The frequencies j of inv_freq (d/2,) that turn less than `angle` radians over `span` tokens."""
    return tuple(int(j) for j in torch.nonzero(inv_freq.double() * span < angle)[:, 0])
