"""What each latent's error is weighted by, per compression method (docs/design.md, "Compression").

`svd`: nothing; `whitened`: the layer's input second moment M; `fisher`: M and the Fisher information of the key and
value outputs (K-FAC), so the weighted singular values are in units of loss, comparable across layers, keys and values.
"""

import torch

from convert.arch import AttentionSpec
from convert.compress.calibrate import LayerStats
from convert.linalg.weighted import Weighting, hermitian_pair_weights, psd_sqrt, static_split
from convert.transform import LayerWeights


def layer_weighting(
    method: str, w: LayerWeights, spec: AttentionSpec, layout: str, stats: LayerStats | None, shrinkage: float = 0.0
) -> Weighting | None:
    """The weighting of `method` (svd, whitened, fisher) for one layer (None for plain SVD), its
    statistics shrunk by `shrinkage` toward data-free ones (`shrunk`)."""
    if method == "svd":
        return None
    assert stats is not None  # every method but svd is calibrated
    affine_key = spec.rope and w.k_bias is not None
    key_moment = stats.augmented() if affine_key else stats.moment
    if spec.qk_norm is not None:  # the normed keys n are what is compressed (identity map on n)
        assert stats.normed_key_moment is not None  # calibrated at the k norm (`normed_keys`)
        key_moment = stats.normed_key_moment
    weighting = Weighting(key_moment=shrunk(key_moment, shrinkage), value_moment=shrunk(stats.moment, shrinkage))
    if method == "whitened":
        return weighting
    return _fisher_weighting(weighting, spec, layout, stats, shrinkage)


def shrunk(m: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 − α)·m + α·mean(diag m)·I: a second moment pulled toward the isotropic one of the same
    trace, so that a direction the calibration text barely excited keeps a floor of weight (the
    data-free weighting, plain SVD's, is α = 1)."""
    if not alpha:
        return m
    return (1 - alpha) * m + alpha * m.diagonal().mean() * torch.eye(m.shape[0], dtype=m.dtype)


def ridge(m: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """m + rel·mean(diag)·I: keeps directions the calibration text never excited invertible."""
    return m + rel * m.diagonal().mean() * torch.eye(m.shape[0], dtype=m.dtype)


def _fisher_weighting(
    weighting: Weighting, spec: AttentionSpec, layout: str, stats: LayerStats, shrinkage: float
) -> Weighting:
    assert stats.key_fisher is not None and stats.value_fisher is not None  # fisher calibration's
    key_f = ridge(shrunk(stats.key_fisher, shrinkage))
    value_f = ridge(shrunk(stats.value_fisher, shrinkage))
    if spec.rope and layout == "absorbed":
        d = spec.head_dim
        weighting.key_pairs = hermitian_pair_weights(key_f, spec.n_kv_heads)  # (d/2, G, G)
        if spec.static_freqs:
            rows = static_split(spec.n_kv_heads, d, spec.static_freqs)[1]
            weighting.key_static_rows = psd_sqrt(key_f[rows][:, rows])
    else:
        weighting.key_rows = psd_sqrt(key_f)
    weighting.value_rows = psd_sqrt(value_f)
    return weighting
