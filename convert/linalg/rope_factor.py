"""Exact absorption with RoPE keys: the per-frequency complex latent (docs/math.md, "RoPE"), the factorizations
of rotating keys (the rotation itself: `convert.rope.rotation`).

Each frequency's keys are factored by a complex SVD, so the latent rotates exactly as the keys do: latent pair p turns
with source frequency `freq_index[p]`, and absorbing `up` into the queries is the ordinary `(W^{UK}_h)ᵀ W^Q_h`.
"""

import torch

from convert.linalg.factor import Factor, real_factor
from convert.rope.rotation import complex_pairs, rotation_blocks


def _kept_pairs(s: torch.Tensor, n_pairs: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (freq j, component t) of the complex singular values to keep.

    All of them when `n_pairs` is None, else the largest `n_pairs` across every
    frequency (plain truncation: the best rank for the keys' Frobenius error).
    Returned sorted by (j, t) so the latent reads in frequency order.
    """
    n_freq, k = s.shape
    flat = torch.arange(n_freq * k)
    if n_pairs is not None:
        flat = torch.topk(s.reshape(-1), n_pairs).indices.sort().values
    return flat // k, flat % k


def rope_factor(
    weight: torch.Tensor, n_kv_heads: int, rank: int | None = None, dtype: torch.dtype = torch.float64
) -> Factor:
    """Factor RoPE key weights (G·d, X) so the latent rotates exactly like the keys.

    rank: real latent dims r_K (even); None keeps every complex component,
    r_K = 2·(d/2)·min(G, X), exact. Returns up (G·d, r_K), down (r_K, X) and
    freq_index (r_K/2,), computed in `dtype` (`work_dtype`).
    """
    if rank is not None and rank % 2:
        raise ValueError(f"a RoPE key latent has an even number of dims (pairs); got rank {rank}")
    a = complex_pairs(weight, n_kv_heads, dtype)  # (d/2, G, X)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)  # (d/2,G,k) (d/2,k) (d/2,k,X)
    j, t = _kept_pairs(s, None if rank is None else rank // 2)
    c = s[j, t, None] * vh[j, t]  # (P, X) complex latent rows
    down = torch.cat([c.real, c.imag])  # (2P, X): [Re block; Im block]
    up = rotation_blocks(u[j, :, t], j, weight.shape[0] // n_kv_heads)  # (G·d, 2P)
    return Factor(up=up, down=down, singular_values=s.reshape(-1), kept=s[j, t], freq_index=j)


def partial_rope_factor(weight: torch.Tensor, n_kv_heads: int, rotary_dim: int) -> Factor:
    """The exact factor of keys whose first `rotary_dim` dims per head rotate (partial RoPE).

    weight: (G·d, X). The latent is [per-frequency part (2P) | NoPE part (n)]: `rope_factor`
    of the rotary rows (pairs (j, j + rotary_dim/2) of each head), then a plain SVD of the
    others, which no rotation touches. `freq_index` (P,) covers the first 2P latent dims;
    RoPE of the latent rotates those and passes the rest, as the source passes its NoPE dims.
    """
    rows, cols = weight.shape
    head_dim = rows // n_kv_heads
    w = weight.double().reshape(n_kv_heads, head_dim, cols)  # (G, d, X)
    rot = rope_factor(w[:, :rotary_dim].reshape(-1, cols), n_kv_heads)  # up (G·rot, 2P)
    nope = real_factor(w[:, rotary_dim:].reshape(-1, cols))  # up (G·(d − rot), n)
    r_rot, r_nope = rot.rank, nope.rank
    up = torch.zeros(n_kv_heads, head_dim, r_rot + r_nope, dtype=torch.float64)  # (G, d, 2P + n)
    up[:, :rotary_dim, :r_rot] = rot.up.reshape(n_kv_heads, rotary_dim, r_rot)
    up[:, rotary_dim:, r_rot:] = nope.up.reshape(n_kv_heads, head_dim - rotary_dim, r_nope)
    s = torch.linalg.svdvals(weight.double())
    kept = torch.cat([rot.kept, nope.kept])  # |complex component|² is the energy of its two real dims
    return Factor(
        up=up.reshape(rows, -1),
        down=torch.cat([rot.down, nope.down]),
        singular_values=s,
        kept=kept,
        freq_index=rot.freq_index,
    )


def aligned_rope_factor(weight: torch.Tensor, n_kv_heads: int) -> Factor:
    """The exact factor whose latent is the keys themselves, one block per KV head.

    weight: (G·d, X). Latent pair p = g·(d/2) + j holds key pair j of group g
    (dims p and p + P, P = G·d/2, rotate_half layout), so `freq_index[p] = j`, and
    the dims of group g are a permutation of that head's key: a per-head function of the key
    (the RMS of a q/k norm, docs/math.md, "Biases and layer features") is the same function
    of its latent block. Returns up (G·d, G·d), a permutation, and down = the permuted rows.
    """
    rows = weight.shape[0]
    head_dim = rows // n_kv_heads
    half = head_dim // 2
    group = torch.arange(n_kv_heads).repeat_interleave(half)  # (P,)
    freq = torch.arange(half).repeat(n_kv_heads)  # (P,)
    order = torch.cat([group * head_dim + freq, group * head_dim + freq + half])  # (2P,) latent dim -> key row
    down = weight.double()[order]  # (2P, X)
    up = torch.zeros(rows, rows, dtype=torch.float64)
    up[order, torch.arange(rows)] = 1.0
    s = torch.linalg.svdvals(weight.double())
    return Factor(up=up, down=down, singular_values=s, kept=s, freq_index=freq)


def latent_groups(latent: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(…, G·d) aligned key latent -> (…, G, d): each KV head's key dims (in pair order)."""
    lead = latent.shape[:-1]
    blocks = latent.reshape(*lead, 2, n_kv_heads, -1)  # (…, 2, G, d/2): [first halves | second halves]
    return blocks.transpose(-3, -2).reshape(*lead, n_kv_heads, -1)  # (…, G, d)


def latent_ungroup(grouped: torch.Tensor) -> torch.Tensor:
    """Inverse of `latent_groups`: (…, G, d) -> (…, G·d) in aligned latent order."""
    *lead, n_kv_heads, head_dim = grouped.shape
    blocks = grouped.reshape(*lead, n_kv_heads, 2, head_dim // 2).transpose(-3, -2)  # (…, 2, G, d/2)
    return blocks.reshape(*lead, n_kv_heads * head_dim)
