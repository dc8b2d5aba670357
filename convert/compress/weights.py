"""What each latent's error is weighted by, per compression method (DESIGN §6).

- svd: nothing (plain weight SVD, the baseline);
- whitened: the layer's input second moment M (activation-whitened SVD);
- fisher: M, and the rows weighted by the Fisher information of the key and
  value outputs, E[g gᵀ] with g = ∂loss/∂k (K-FAC): the weighted singular values
  are then in units of loss, comparable across layers, keys and values.
"""

from dataclasses import dataclass

import torch

from convert.arch import AttentionSpec
from convert.compress.calibrate import LayerStats
from convert.linalg.weighted import psd_sqrt
from convert.transform import LayerWeights

METHODS = ("svd", "whitened", "fisher")


@dataclass
class Weighting:
    """Weights of one layer's key and value errors (None: unweighted)."""

    key_moment: torch.Tensor | None = None  # (X, X), X = D (+1 for an affine key latent)
    key_rows: torch.Tensor | None = None  # (G·d, G·d), real latents
    key_pairs: torch.Tensor | None = None  # (G, d/2), per-frequency complex latents
    value_moment: torch.Tensor | None = None  # (D, D)
    value_rows: torch.Tensor | None = None  # (G·d, G·d)


def pair_rms(grams: torch.Tensor) -> torch.Tensor:
    """(G, d, d) -> (G, d/2): RoPE turns each pair by every angle, so a pair's weight is
    the mean power of its two dims (rotation-averaged: one scalar per pair)."""
    diag = grams.diagonal(dim1=-2, dim2=-1)  # (G, d)
    half = diag.shape[-1] // 2
    return ((diag[:, :half] + diag[:, half:]) / 2).clamp(min=0).sqrt()


def layer_weighting(
    method: str, w: LayerWeights, spec: AttentionSpec, layout: str, stats: LayerStats | None
) -> Weighting | None:
    """The weighting of `method` (svd, whitened, fisher) for one layer (None for plain SVD)."""
    if method == "svd":
        return None
    affine_key = spec.rope and w.k_bias is not None
    weighting = Weighting(key_moment=stats.augmented() if affine_key else stats.moment, value_moment=stats.moment)
    if method == "whitened":
        return weighting
    return _fisher_weighting(weighting, spec, layout, stats)


def _ridge(m: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """m + rel·mean(diag)·I: keeps directions the calibration text never excited invertible."""
    return m + rel * m.diagonal().mean() * torch.eye(m.shape[0], dtype=m.dtype)


def _fisher_weighting(weighting: Weighting, spec: AttentionSpec, layout: str, stats: LayerStats) -> Weighting:
    key_f, value_f = _ridge(stats.key_fisher), _ridge(stats.value_fisher)
    if spec.rope and layout == "absorbed":
        d = spec.head_dim
        blocks = (
            key_f.reshape(spec.n_kv_heads, d, spec.n_kv_heads, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        )  # (G, d, d)
        weighting.key_pairs = pair_rms(blocks)
    else:
        weighting.key_rows = psd_sqrt(key_f)
    weighting.value_rows = psd_sqrt(value_f)
    return weighting
