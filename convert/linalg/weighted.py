"""Weighted low-rank factorizations for compression below the exact rank (DESIGN §6).

The error that matters is not ‖W − up·down‖ but what it does to the layer:
    ‖B (W − up·down) S‖_F,   S = M^{1/2},  M = E[y yᵀ] over the layer's real inputs,
and B weights the rows by what reads them: the queries for keys (score error
q_hᵀ Δk), W^O for values (output error W^O_h Δv). With B = I, S = I this is
plain weight SVD; with B = I, S = M^{1/2} activation-whitened SVD.

The best rank-r `down` spans the top-r left singular directions U_r of Z = B W S:
down = U_rᵀ B W. Given `down`, the best `up` is the least-squares fit
up = W M downᵀ (down M downᵀ)⁻¹, which does not depend on B: no matrix square
root is ever inverted.
"""

import torch

from convert.linalg.factor import Factor
from convert.linalg.rope import _rotation_blocks, complex_pairs


def psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a positive semi-definite matrix (negative round-off clipped)."""
    vals, vecs = torch.linalg.eigh(m.double())
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def _refit_up(weight: torch.Tensor, down: torch.Tensor, moment: torch.Tensor) -> torch.Tensor:
    """argmin_up E‖(W − up·down) y‖² = W M downᴴ (down M downᴴ)⁻¹."""
    m = moment.to(down.dtype)
    gram = down @ m @ down.mH  # (r, r)
    ridge = 1e-12 * gram.diagonal().real.mean().clamp(min=1e-300) * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + ridge, (weight.to(down.dtype) @ m @ down.mH).mH).mH


def weighted_spectrum(
    weight: torch.Tensor, row_weight: torch.Tensor | None, moment: torch.Tensor | None
) -> torch.Tensor:
    """Singular values of Z = B W S: the error of keeping r is the sum of the rest squared."""
    return torch.linalg.svdvals(_weighted(weight.double(), row_weight, moment))


def _weighted(weight, row_weight, moment):
    z = weight if row_weight is None else row_weight @ weight
    return z if moment is None else z @ psd_sqrt(moment)


def weighted_factor(
    weight: torch.Tensor, rank: int, row_weight: torch.Tensor | None = None, moment: torch.Tensor | None = None
) -> Factor:
    """Rank-`rank` factorization of weight (m, X) minimizing ‖B (W − up·down) M^{1/2}‖.

    row_weight: B (m, m) or None; moment: M (X, X) or None (plain SVD).
    """
    w = weight.double()
    u, s, _ = torch.linalg.svd(_weighted(w, row_weight, moment), full_matrices=False)
    down = u[:, :rank].T @ (w if row_weight is None else row_weight @ w)  # (r, X)
    up = (
        _refit_up(w, down, moment)
        if moment is not None
        else u[:, :rank]
        if row_weight is None
        else _refit_up(w, down, torch.eye(w.shape[1], dtype=w.dtype))
    )
    return Factor(up=up, down=down, singular_values=s, kept=s[:rank])


def pair_weighted_moment_spectrum(weight, n_kv_heads, pair_weight, moment) -> torch.Tensor:
    """(d/2, k) singular values of diag(w_j) A_j M^{1/2} per frequency j (RoPE keys)."""
    a = _weighted_pairs(weight, n_kv_heads, pair_weight, moment)
    return torch.linalg.svdvals(a)


def _weighted_pairs(weight, n_kv_heads, pair_weight, moment):
    a = complex_pairs(weight, n_kv_heads)  # (d/2, G, X)
    if pair_weight is not None:
        a = a * pair_weight.T[:, :, None]  # pair_weight (G, d/2)
    if moment is not None:
        a = a @ psd_sqrt(moment).to(a.dtype)
    return a


def weighted_rope_factor(
    weight: torch.Tensor,
    n_kv_heads: int,
    rank: int,
    pair_weight: torch.Tensor | None = None,
    moment: torch.Tensor | None = None,
) -> Factor:
    """Rank-`rank` RoPE key latent (per-frequency complex, see `rope_factor`) under the weighted error.

    pair_weight: (G, d/2) real weights of key pair (g, j), e.g. the RMS of the
    queries that read it (rotation-averaged, so one scalar per pair).
    The `rank // 2` complex components with the largest weighted singular
    values across all frequencies are kept.
    """
    a = complex_pairs(weight, n_kv_heads)  # (d/2, G, X)
    u, s, _ = torch.linalg.svd(_weighted_pairs(weight, n_kv_heads, pair_weight, moment), full_matrices=False)
    flat = torch.topk(s.reshape(-1), rank // 2).indices.sort().values
    j, t = flat // s.shape[1], flat % s.shape[1]
    u_sel = u[j, :, t]  # (P, G) left directions in the weighted space
    b = a if pair_weight is None else a * pair_weight.T[:, :, None]
    down_c = torch.einsum("pg,pgx->px", u_sel.conj(), b[j])  # (P, X): U_rᴴ diag(w) A_j
    up_c = _refit_pairs(a, down_c, j, moment)  # (P, G)
    down = torch.cat([down_c.real, down_c.imag])  # (2P, X)
    up = _rotation_blocks(up_c, j, weight.shape[0] // n_kv_heads)
    return Factor(up=up, down=down, singular_values=s.reshape(-1), kept=s[j, t], freq_index=j)


def _refit_pairs(a: torch.Tensor, down_c: torch.Tensor, freq: torch.Tensor, moment) -> torch.Tensor:
    """Per frequency, least-squares complex up-projection for the kept latent rows."""
    m = torch.eye(a.shape[-1], dtype=a.dtype) if moment is None else moment.to(a.dtype)
    up = torch.zeros(down_c.shape[0], a.shape[1], dtype=a.dtype)  # (P, G)
    for j in freq.unique():
        rows = (freq == j).nonzero()[:, 0]
        up[rows] = _refit_up(a[j], down_c[rows], m).T
    return up
