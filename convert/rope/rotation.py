"""The rotation: rotate_half RoPE (the convention of HF Llama/Mistral/Qwen2: pair j = dims (j, j + d/2)) on
queries, keys and latents, and the same pairs read as complex numbers, which a rotation multiplies."""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE, the convention of HF Llama/Mistral/Qwen2, on the first cos.shape[-1] dims
    of x; the others pass unrotated (partial RoPE's NoPE dims, and a latent's NoPE part)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return _rotated(x, cos, sin)
    head, tail = x[..., :rotary], x[..., rotary:]
    return torch.cat([_rotated(head, cos, sin), tail], dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin in one new tensor of x's size and memory layout (not three, and
    not a contiguous copy: queries (B, H, L, d) viewed from a (B, L, H·d) projection keep that
    layout, so SDPA's output, allocated like them, reshapes to (B, L, H·d) without a copy)."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)  # x's strides where x is dense
    out[..., :half] = x[..., half:]
    out[..., :half].neg_()
    out[..., half:] = x[..., :half]
    return out.mul_(sin).addcmul_(x, cos)


def latent_cos_sin(cos: torch.Tensor, sin: torch.Tensor, freq_index: torch.Tensor):
    """Source (…, d) cos/sin -> latent (…, r_K): pair p takes frequency freq_index[p].

    Gathering from the source model's own cos/sin keeps every RoPE variant
    (rope_theta, llama3/yarn/linear scaling, attention scaling) exactly as the
    source computes it.
    """
    cos_p = cos.index_select(-1, freq_index)  # (…, P)
    sin_p = sin.index_select(-1, freq_index)
    return torch.cat([cos_p, cos_p], dim=-1), torch.cat([sin_p, sin_p], dim=-1)  # (…, 2P)


def rotate_half_pairs(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half's pair j: rows (j, j + d/2), each (d/2,) long."""
    half = head_dim // 2
    return torch.arange(half), torch.arange(half) + half


def complex_pairs(weight: torch.Tensor, n_kv_heads: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(G·d, X) real key weights -> (d/2, G, X) complex `A_j` per frequency j, of real part `dtype`."""
    w = weight.to(dtype).reshape(n_kv_heads, -1, weight.shape[-1])  # (G, d, X)
    half = w.shape[1] // 2
    a = torch.complex(w[:, :half], w[:, half:])  # (G, d/2, X)
    return a.permute(1, 0, 2)  # (d/2, G, X)


def rotation_blocks(u_sel: torch.Tensor, freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Real (G·d, 2P) up-projection from the complex coefficients u_sel (P, G).

    Key pair (g, j) = Σ_p U[g,p]·c_p, written out in real and imaginary parts:
        k[j]       = Re U · Re c − Im U · Im c
        k[j + d/2] = Im U · Re c + Re U · Im c
    """
    n_pairs, n_groups = u_sel.shape
    half = head_dim // 2
    p = torch.arange(n_pairs)
    up = torch.zeros(n_groups, head_dim, 2 * n_pairs, dtype=u_sel.real.dtype)  # (G, d, 2P)
    coeff = u_sel.T  # (G, P)
    up[:, freq, p] = coeff.real
    up[:, freq, n_pairs + p] = -coeff.imag
    up[:, freq + half, p] = coeff.imag
    up[:, freq + half, n_pairs + p] = coeff.real
    return up.reshape(n_groups * head_dim, 2 * n_pairs)  # (G·d, 2P)
