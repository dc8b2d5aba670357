"""Absorbing up-projections into the query and output projections (DESIGN §3).

Per head h, with up-projection block `W^{U}_h` (d × r):
    Ŵ^Q_h = (W^{UK}_h)ᵀ W^Q_h   (r × X)  so that  q̂_hᵀ c = q_hᵀ k_h
    Ŵ^O_h = W^O_h W^{UV}_h      (D × r)  so that  Σ_h Ŵ^O_h Σα c = Σ_h W^O_h Σα v_h
"""

import torch


def absorb_query(w_q: torch.Tensor, up_k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(H·d, X) query weights and (H·d, r) key up-projection -> (H·r, X).

    X may include a bias column; the result's columns follow it.
    """
    q = w_q.double().reshape(n_heads, -1, w_q.shape[-1])  # (H, d, X)
    u = up_k.double().reshape(n_heads, -1, up_k.shape[-1])  # (H, d, r)
    return torch.einsum("hdr,hdx->hrx", u, q).reshape(-1, w_q.shape[-1])  # (H·r, X)


def absorb_output(w_o: torch.Tensor, up_v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(D, H·d) output weights and (H·d, r) value up-projection -> (D, H·r)."""
    o = w_o.double().reshape(w_o.shape[0], n_heads, -1)  # (D, H, d)
    u = up_v.double().reshape(n_heads, -1, up_v.shape[-1])  # (H, d, r)
    return torch.einsum("Dhd,hdr->Dhr", o, u).reshape(w_o.shape[0], -1)  # (D, H·r)
