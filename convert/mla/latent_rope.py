"""The latent's RoPE as one operator (`latent_rope`, forward and backward), and the positions a factored
layout's cache keeps beside its latents so that cached keys rotate at their own positions (the rotation
itself: `convert.rope.rotation`)."""

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from convert.rope.rotation import apply_rope, latent_cos_sin


@torch.library.custom_op("convert::latent_rope", mutates_args=())
def latent_rope(x: Tensor, cos: Tensor, sin: Tensor, freq_index: Tensor) -> Tensor:
    """`apply_rope(x, *latent_cos_sin(cos, sin, freq_index))`, the same values, as one operator
    (forward and backward) that torch.compile runs as it is. x (…, r_K): a key latent or latent
    queries; cos, sin (…, d): the source's, broadcasting over x's leading dims; freq_index (P,).

    After compression the latent's widths differ from layer to layer, and traced, its gather and
    rotation gave every layer its own generated kernels, forward and backward: SmolLM2 absorbed at
    25% of the cache compiled in 1.6× the original's time (bench/train_step.py)."""
    return apply_rope(x, *latent_cos_sin(cos, sin, freq_index))


@latent_rope.register_fake
def _latent_rope_shape(x, cos, sin, freq_index):
    if 2 * freq_index.shape[0] == x.shape[-1]:  # `_rotated`: x's layout
        return torch.empty_like(x)
    return x.new_empty(x.shape)  # `torch.cat`'s: contiguous


@torch.library.custom_op("convert::latent_rope_backward", mutates_args=())
def latent_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, freq_index: Tensor) -> Tensor:
    """The gradient of `latent_rope` with respect to x (a new contiguous tensor): on the first 2P
    dims the rotation's transpose, grad·cos + rotate_halfᵀ(grad·sin) (the products and their sum
    rounded as autograd rounds them through `apply_rope`), the others passed."""
    cos, sin = latent_cos_sin(cos, sin, freq_index)  # (…, 2P)
    rotary, half = cos.shape[-1], cos.shape[-1] // 2
    head = grad[..., :rotary]
    by_sin = head * sin
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    torch.mul(head, cos, out=out[..., :rotary])
    out[..., :half] += by_sin[..., half:]  # rotate_halfᵀ(y) = [y₂, −y₁]
    out[..., half:rotary] -= by_sin[..., :half]
    out[..., rotary:] = grad[..., rotary:]
    return out


@latent_rope_backward.register_fake
def _latent_rope_backward_shape(grad, cos, sin, freq_index):
    return grad.new_empty(grad.shape)


def _save_angles(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:])


def _latent_rope_grad(ctx, grad):
    return latent_rope_backward(grad, *ctx.saved_tensors), None, None, None


def _latent_rope_backward_grad(ctx, grad):  # a linear map's transpose, transposed: the map
    return latent_rope(grad, *ctx.saved_tensors), None, None, None


latent_rope.register_autograd(_latent_rope_grad, setup_context=_save_angles)
latent_rope_backward.register_autograd(_latent_rope_backward_grad, setup_context=_save_angles)


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
