"""RoPE on queries, keys and latents (rotate_half, as the source computes it), and the positions a
factored layout's cache keeps beside its latents so that cached keys rotate at their own positions."""

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer


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


def cached_positions(layer, positions: torch.Tensor) -> torch.Tensor:
    """The positions (B, S) of the keys `layer` (a transformers cache layer, just updated with this
    call's latents) returns. A twin layer of the same kind stores them (B, 1, S, 1) and so keeps
    them in step through everything the kind does: grow, slide, roll, static slots (then the
    returned slots past the written ones are masked, as the latents' are). A layer emptied since
    (`Cache.reset`, or a new sequence in a reused static cache) gets a new twin at its prefill."""
    twin = getattr(layer, "mla_positions", None)
    if twin is None or (positions.shape[-1] > 1 and _starts_anew(layer, positions.shape[-1])):
        layer.mla_positions = twin = _twin_layer(layer)
    stored = positions[:, None, :, None]  # (B, 1, L, 1): as keys, with no values (B, 1, L, 0)
    keys, _ = twin.update(stored, stored[..., :0])  # (B, 1, S, 1)
    return keys[:, 0, :, 0]  # (B, S)


def _starts_anew(layer, length: int) -> bool:
    """Whether `layer` holds only this call's `length` keys (its length is a tensor in static layers:
    read here at a prefill, never in a decode step)."""
    return int(layer.get_seq_length()) == length


def _twin_layer(layer):
    """An empty cache layer of `layer`'s kind (its window, its static size)."""
    if isinstance(layer, StaticSlidingWindowLayer):
        return StaticSlidingWindowLayer(max_cache_len=layer.max_cache_len, sliding_window=layer.max_cache_len)
    if isinstance(layer, StaticLayer):
        return StaticLayer(max_cache_len=layer.max_cache_len)
    if isinstance(layer, DynamicSlidingWindowLayer):
        return DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
    return DynamicLayer()
