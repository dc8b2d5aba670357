"""Weighted low-rank factorizations for compression below the exact rank (docs/design.md, "Compression").

Each minimizes what the error does to the layer, ‖B (W − up·down) M^{1/2}‖_F (M the second moment of the layer's
inputs, B a weight on the rows; B = I and M = I is plain weight SVD).
"""

from dataclasses import dataclass

import torch

from convert.linalg.factor import Factor
from convert.rope.rotation import complex_pairs, rotation_blocks


@dataclass
class Weighting:
    """Weights of one layer's key and value errors (None: unweighted); `convert.compress.layer_weighting`
    gives them per compression method."""

    key_moment: torch.Tensor | None = None  # (X, X), X = D (+1 for an affine key latent); q/k norm: E[n nᵀ]
    key_rows: torch.Tensor | None = None  # (G·d, G·d), real latents
    key_pairs: torch.Tensor | None = None  # per-frequency complex latents: (G, d/2) diagonal or (d/2, G, G)
    value_moment: torch.Tensor | None = None  # (D, D)
    value_rows: torch.Tensor | None = None  # (G·d, G·d)
    key_static_rows: torch.Tensor | None = None  # (2·G·|S|,)² rows of the static frequencies S (NoPE part)
    key_cross: torch.Tensor | None = None  # E[y° yᵀ] (X, X): sequential calibration, original vs compressed inputs
    value_cross: torch.Tensor | None = None  # (D, D)


def psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a positive semi-definite matrix (negative round-off clipped)."""
    vals, vecs = torch.linalg.eigh(m.double())
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def _refit_up(weight: torch.Tensor, down: torch.Tensor, moment: torch.Tensor, cross=None) -> torch.Tensor:
    """argmin_up E‖W y° − up·down y‖² = W C downᴴ (down M downᴴ)⁻¹, M = E[y yᴴ], C = E[y° yᴴ].

    y° is what the original layer sees, y what the compressed model feeds this one
    (sequential calibration); without `cross` they are the same inputs and C = M."""
    m = moment.to(down.dtype)
    c = m if cross is None else cross.to(down.dtype)
    gram = down @ m @ down.mH  # (r, r)
    ridge = 1e-12 * gram.diagonal().real.mean().clamp(min=1e-300) * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + ridge, (weight.to(down.dtype) @ c @ down.mH).mH).mH


def weighted_spectrum(
    weight: torch.Tensor, row_weight: torch.Tensor | None, moment: torch.Tensor | None
) -> torch.Tensor:
    """Singular values of Z = B W S: the error of keeping r is the sum of the rest squared."""
    return torch.linalg.svdvals(_weighted(weight.double(), row_weight, moment))


def _weighted(weight, row_weight, moment):
    z = weight if row_weight is None else row_weight @ weight
    return z if moment is None else z @ psd_sqrt(moment)


def weighted_factor(
    weight: torch.Tensor,
    rank: int | None,
    row_weight: torch.Tensor | None = None,
    moment: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
) -> Factor:
    """Rank-`rank` factorization of weight (m, X) minimizing ‖B (W − up·down) M^{1/2}‖.

    rank: None keeps every component. row_weight: B (m, m) or None; moment: M (X, X) or None
    (plain SVD); cross: E[y° yᵀ] when the original layer's inputs y° differ from these (`_refit_up`).
    """
    w = weight.double()
    u, s, _ = torch.linalg.svd(_weighted(w, row_weight, moment), full_matrices=False)
    down = u[:, :rank].T @ (w if row_weight is None else row_weight @ w)  # (r, X)
    up = (
        _refit_up(w, down, moment, cross)
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


def _row_weighted(a: torch.Tensor, pair_weight: torch.Tensor | None) -> torch.Tensor:
    """B_j A_j per frequency: pair_weight (G, d/2) real, a diagonal B_j; or (d/2, G, G) complex, B_j itself."""
    if pair_weight is None:
        return a
    if pair_weight.dim() == 3:
        return pair_weight.to(a.dtype) @ a
    return a * pair_weight.T[:, :, None]


def select_freqs(pair_weight: torch.Tensor | None, freqs: torch.Tensor) -> torch.Tensor | None:
    """The pair weights of frequencies `freqs` only (either form of `_row_weighted`)."""
    if pair_weight is None:
        return None
    return pair_weight[freqs] if pair_weight.dim() == 3 else pair_weight[:, freqs]


def hermitian_pair_weights(key_fisher: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(d/2, G, G) complex row weights B_j = H_j^{1/2} of the per-frequency complex key latents.

    RoPE turns the error e_j = a + i·b of frequency j (a, b: the pair's first and second dims
    in all G heads) by the same angle in every head; averaged over the angle, the Fisher
    quadratic form [a; b]ᵀ F_j [a; b] is e_jᴴ H_j e_j with the Hermitian
        H_j = (F_aa + F_bb)/2 + i (F_ba − F_ab)/2,
    which keeps the cross-head Fisher terms that a diagonal weight per pair (one RMS per head) drops.
    """
    f = key_fisher.double()
    head_dim = f.shape[0] // n_kv_heads
    half = head_dim // 2
    blocks = f.reshape(n_kv_heads, head_dim, n_kv_heads, head_dim)  # (G, d, G, d)
    first, second = slice(0, half), slice(half, head_dim)
    f_aa = blocks[:, first, :, first].permute(1, 3, 0, 2).diagonal(dim1=0, dim2=1)  # (G, G, d/2)
    f_bb = blocks[:, second, :, second].permute(1, 3, 0, 2).diagonal(dim1=0, dim2=1)
    f_ab = blocks[:, first, :, second].permute(1, 3, 0, 2).diagonal(dim1=0, dim2=1)
    f_ba = blocks[:, second, :, first].permute(1, 3, 0, 2).diagonal(dim1=0, dim2=1)
    hermitian = torch.complex((f_aa + f_bb) / 2, (f_ba - f_ab) / 2).permute(2, 0, 1)  # (d/2, G, G)
    vals, vecs = torch.linalg.eigh(hermitian)
    return (vecs * vals.clamp(min=0).sqrt()[:, None, :].to(vecs.dtype)) @ vecs.mH


def _weighted_pairs(weight, n_kv_heads, pair_weight, moment):
    a = _row_weighted(complex_pairs(weight, n_kv_heads), pair_weight)  # (d/2, G, X)
    if moment is not None:
        a = a @ psd_sqrt(moment).to(a.dtype)
    return a


def weighted_rope_factor(
    weight: torch.Tensor,
    n_kv_heads: int,
    rank: int,
    pair_weight: torch.Tensor | None = None,
    moment: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
) -> Factor:
    """Rank-`rank` RoPE key latent (per-frequency complex, see `rope_factor`) under the weighted error.

    pair_weight: (G, d/2) real weights of key pair (g, j), e.g. the RMS of the
    queries that read it (rotation-averaged, so one scalar per pair); or (d/2, G, G)
    complex row weights per frequency (`hermitian_pair_weights`).
    The `rank // 2` complex components with the largest weighted singular
    values across all frequencies are kept.
    """
    a = complex_pairs(weight, n_kv_heads)  # (d/2, G, X)
    u, s, _ = torch.linalg.svd(_weighted_pairs(weight, n_kv_heads, pair_weight, moment), full_matrices=False)
    flat = torch.topk(s.reshape(-1), rank // 2).indices.sort().values
    j, t = flat // s.shape[1], flat % s.shape[1]
    u_sel = u[j, :, t]  # (P, G) left directions in the weighted space
    b = _row_weighted(a, pair_weight)
    down_c = torch.einsum("pg,pgx->px", u_sel.conj(), b[j])  # (P, X): U_rᴴ diag(w) A_j
    up_c = _refit_pairs(a, down_c, j, moment, cross)  # (P, G)
    down = torch.cat([down_c.real, down_c.imag])  # (2P, X)
    up = rotation_blocks(up_c, j, weight.shape[0] // n_kv_heads)
    return Factor(up=up, down=down, singular_values=s.reshape(-1), kept=s[j, t], freq_index=j)


def _refit_pairs(a: torch.Tensor, down_c: torch.Tensor, freq: torch.Tensor, moment, cross=None) -> torch.Tensor:
    """Per frequency, least-squares complex up-projection for the kept latent rows."""
    m = torch.eye(a.shape[-1], dtype=a.dtype) if moment is None else moment.to(a.dtype)
    up = torch.zeros(down_c.shape[0], a.shape[1], dtype=a.dtype)  # (P, G)
    for j in freq.unique():
        rows = (freq == j).nonzero()[:, 0]
        up[rows] = _refit_up(a[j], down_c[rows], m, cross).T
    return up


# ------------------------------------------------------------------ static frequencies as NoPE dims


def static_split(n_kv_heads: int, head_dim: int, static: tuple[int, ...]):
    """Key rows of the rotary frequencies and of the `static` ones, and the rotary frequencies.

    Returns (rotary rows (G·2|R|,), static rows (G·2|S|,), rotary frequencies R (|R|,)); each
    head's rows in rotate_half order [first dims of the pairs | second dims], so the rotary
    rows form keys of head dim 2|R| that `complex_pairs` reads as frequencies R in order."""
    half = head_dim // 2
    rotary = [j for j in range(half) if j not in set(static)]

    def rows(freqs: list[int]) -> torch.Tensor:
        per_head = freqs + [j + half for j in freqs]
        return torch.tensor([g * head_dim + i for g in range(n_kv_heads) for i in per_head], dtype=torch.long)

    return rows(rotary), rows(list(static)), torch.tensor(rotary, dtype=torch.long)


def _decoupled_spectra(weight, n_kv_heads, static, weighting: Weighting):
    """(complex spectrum of the rotary part (|R|, k), real spectrum of the static part)."""
    w, moment = weight.double(), weighting.key_moment
    rot_rows, st_rows, rotary = static_split(n_kv_heads, w.shape[0] // n_kv_heads, static)
    pairs = select_freqs(weighting.key_pairs, rotary)
    s_rot = pair_weighted_moment_spectrum(w[rot_rows], n_kv_heads, pairs, moment)
    return s_rot, weighted_spectrum(w[st_rows], weighting.key_static_rows, moment)


def _per_dim(s_rot: torch.Tensor, s_static: torch.Tensor) -> list[tuple[float, int, int]]:
    """Components by error removed per cache dim, best first: (σ²/dims, dims, index). A complex
    component spans two real dims of energy |s|² together; a static one, one dim."""
    comps = [(float(v) ** 2 / 2, 2, i) for i, v in enumerate(s_rot.reshape(-1))]
    comps += [(float(v) ** 2, 1, i) for i, v in enumerate(s_static)]
    return sorted(comps, key=lambda c: -c[0])


def decoupled_spectrum(weight, n_kv_heads, static, weighting: Weighting | None = None):
    """The key latent's spectrum per cache dim (descending, cost 1 each) for budget allocation:
    each complex component of the rotary part as two dims of |s|/√2, each static one as itself.
    weighting: its key pairs, key moment and static rows (None: unweighted)."""
    s_rot, s_static = _decoupled_spectra(weight, n_kv_heads, static, weighting or Weighting())
    values = [value for value, dims, _ in _per_dim(s_rot, s_static) for _ in range(dims)]
    return torch.tensor(values, dtype=torch.float64).sqrt()


def decoupled_rope_factor(
    weight: torch.Tensor,
    n_kv_heads: int,
    rank: int,
    static: tuple[int, ...],
    weighting: Weighting | None = None,
) -> Factor:
    """Rank-`rank` RoPE key latent [rotary pairs (2P) | static NoPE dims (n)] under the weighted error.

    The frequencies in `static` turn so little over the model's span that they are cached
    unrotated: their key rows (all heads) are factored together by `weighted_factor`, free of
    the one-frequency-per-pair constraint; the others by `weighted_rope_factor`. The `rank` dims
    go to whichever components remove the most weighted error per dim (a complex component
    costs two). `freq_index` (P,) covers the first 2P dims; RoPE of the latent leaves the rest.
    weighting: the key's pair weights, moment, cross moment and the row weight of the static rows
    (`static_split`, e.g. Fisher's); None: unweighted.
    """
    weighting = weighting or Weighting()
    moment, cross = weighting.key_moment, weighting.key_cross
    w = weight.double()
    rows, cols = w.shape
    rot_rows, st_rows, rotary = static_split(n_kv_heads, rows // n_kv_heads, static)
    s_rot, s_static = _decoupled_spectra(w, n_kv_heads, static, weighting)
    left, n_pairs, n_static = rank, 0, 0
    for _, dims, _ in _per_dim(s_rot, s_static):
        if dims <= left:
            left -= dims
            n_pairs, n_static = n_pairs + (dims == 2), n_static + (dims == 1)
    up, down = torch.zeros(rows, rank, dtype=torch.float64), torch.zeros(rank, cols, dtype=torch.float64)
    kept_parts: list[torch.Tensor] = []
    freq = torch.zeros(0, dtype=torch.long)
    if n_pairs:
        pairs = select_freqs(weighting.key_pairs, rotary)
        rot = weighted_rope_factor(w[rot_rows], n_kv_heads, 2 * n_pairs, pairs, moment, cross)
        up[rot_rows, : 2 * n_pairs], down[: 2 * n_pairs], freq = rot.up, rot.down, rotary[rot.freq_index]
        kept_parts.append(rot.kept)
    if n_static:
        nope = weighted_factor(w[st_rows], n_static, weighting.key_static_rows, moment, cross)
        up[st_rows, 2 * n_pairs : 2 * n_pairs + n_static] = nope.up
        down[2 * n_pairs : 2 * n_pairs + n_static] = nope.down
        kept_parts.append(nope.kept)
    # `left` (at most one dim, when only complex components remained) stays a zero latent dim
    singular = torch.cat([s_rot.reshape(-1), s_static])
    kept = torch.cat(kept_parts) if kept_parts else singular[:0]
    return Factor(up=up, down=down, singular_values=singular, kept=kept, freq_index=freq)
