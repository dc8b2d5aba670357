"""Absorbing up-projections into the query and output projections (docs/math.md, "Absorption").

Per head h, with up-projection block `W^{U}_h` (d × r):
    Ŵ^Q_h = (W^{UK}_h)ᵀ W^Q_h   (r × X)  so that  q̂_hᵀ c = q_hᵀ k_h
    Ŵ^O_h = W^O_h W^{UV}_h      (D × r)  so that  Σ_h Ŵ^O_h Σα c = Σ_h W^O_h Σα v_h
"""

import torch

from convert.linalg.factor import work_dtype

BLOCK_BYTES = 64 * 2**20  # float64 bytes of one block of heads' products


def _head_blocks(n_heads: int, block_numel: int):
    """Slices of heads whose float64 products (block_numel values per head) fit BLOCK_BYTES."""
    step = max(1, BLOCK_BYTES // (8 * block_numel))
    return (slice(h, min(h + step, n_heads)) for h in range(0, n_heads, step))


def absorb_query(
    w_q: torch.Tensor, up_k: torch.Tensor, n_heads: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """(H·d, X) query weights and (H·d, r) key up-projection -> (H·r, X) in `dtype`.

    X may include a bias column; the result's columns follow it. The products are computed
    in `work_dtype(dtype)` (float64; float32 for a half-precision result) a block of heads at
    a time and cast as they are stored, so only the result (in `dtype`) and one block are in
    memory.
    """
    work = work_dtype(dtype)
    q = w_q.reshape(n_heads, -1, w_q.shape[-1])  # (H, d, X)
    u = up_k.reshape(n_heads, -1, up_k.shape[-1])  # (H, d, r)
    out = torch.empty(n_heads, u.shape[-1], q.shape[-1], dtype=dtype)  # (H, r, X)
    for h in _head_blocks(n_heads, u.shape[-1] * q.shape[-1]):
        out[h] = torch.einsum("hdr,hdx->hrx", u[h].to(work), q[h].to(work))  # (h, r, X)
    return out.reshape(-1, w_q.shape[-1])  # (H·r, X)


def absorb_output(
    w_o: torch.Tensor, up_v: torch.Tensor, n_heads: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """(D, H·d) output weights and (H·d, r) value up-projection -> (D, H·r) in `dtype`, a block
    of heads at a time in `work_dtype(dtype)` (as `absorb_query`)."""
    work = work_dtype(dtype)
    o = w_o.reshape(w_o.shape[0], n_heads, -1)  # (D, H, d)
    u = up_v.reshape(n_heads, -1, up_v.shape[-1])  # (H, d, r)
    out = torch.empty(w_o.shape[0], n_heads, u.shape[-1], dtype=dtype)  # (D, H, r)
    for h in _head_blocks(n_heads, w_o.shape[0] * u.shape[-1]):
        out[:, h] = torch.einsum("Dhd,hdr->Dhr", o[:, h].to(work), u[h].to(work))  # (D, h, r)
    return out.reshape(w_o.shape[0], -1)  # (D, H·r)
