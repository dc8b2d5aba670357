"""The head map: which key/value group `g(h)` each query head `h` reads (docs/math.md, "Notation")."""

import torch

from convert.arch.registry import HEAD_MAPS


def group_of_head(n_heads: int, n_kv_heads: int, head_map: str) -> torch.Tensor:
    """Return `g(h)` for h = 0..n_heads-1 as a long tensor of shape (n_heads,).

    `grouped` (Hugging Face `repeat_kv`): g(h) = h // (H/G).
    `tiled` (the seed's "concatenate H/G copies"): g(h) = h mod G.
    """
    heads = torch.arange(n_heads)
    if head_map == "grouped":
        return heads // (n_heads // n_kv_heads)
    if head_map == "tiled":
        return heads % n_kv_heads
    raise ValueError(f"unknown head map {head_map!r}; use one of {HEAD_MAPS}")


def expand_groups(per_group: torch.Tensor, n_heads: int, n_kv_heads: int, head_map: str) -> torch.Tensor:
    """Stack, for each query head, the row block of its group.

    per_group: (G·d, X) -> (H·d, X). This is `W̃^M` when applied to `W^M`, and
    `W^{UM}` when applied to the left factor of `W^M`.
    """
    head_dim = per_group.shape[0] // n_kv_heads
    blocks = per_group.reshape(n_kv_heads, head_dim, -1)  # (G, d, X)
    picked = blocks[group_of_head(n_heads, n_kv_heads, head_map)]  # (H, d, X)
    return picked.reshape(n_heads * head_dim, -1)  # (H·d, X)


def tile_rows(weight: torch.Tensor, n_heads: int, n_kv_heads: int, head_map: str) -> torch.Tensor:
    """`W̃^M` (H·d × D): the GQA key/value projection repeated for every query head."""
    return expand_groups(weight, n_heads, n_kv_heads, head_map)
