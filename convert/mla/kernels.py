"""The arithmetic of MLA attention outside the module: scores through explicit products or SDPA
(a latent shared by all heads, never copied per head), causal masks, and projections computed for
a slice of heads only (`convert.mla.attention.MLAAttention` runs its heads in chunks)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sliceable(module: nn.Module) -> bool:
    """A plain `nn.Linear`, run by nothing but its own forward: no subclass, no hook, no forward
    replaced on the instance (accelerate's offloading does that to put the weights in place)."""
    plain = type(module) is nn.Linear and "forward" not in vars(module)
    return plain and not module._forward_hooks and not module._forward_pre_hooks


def cols(heads: slice, width: int) -> slice:
    """The features of `heads` in a (…, H·width) projection."""
    return slice(heads.start * width, heads.stop * width)


def linear_rows(linear: nn.Linear, x: torch.Tensor, rows: slice, whole: int) -> torch.Tensor:
    """linear(x)[..., rows] computing only those output features (the module itself when `rows`
    covers all `whole` of them: a wrapped or quantized module runs as it is)."""
    if rows.start == 0 and rows.stop == whole:
        return linear(x)
    bias = None if linear.bias is None else linear.bias[rows]
    return F.linear(x, linear.weight[rows], bias)


def linear_cols_add(linear: nn.Linear, x: torch.Tensor, cols: slice, whole: int, out: torch.Tensor | None):
    """out + linear restricted to input features `cols` applied to x (B, L, |cols|); the bias once,
    with the first chunk (`out` None). All `whole` input features: the module itself."""
    if out is None and cols.start == 0 and cols.stop == whole:
        return linear(x)
    weight = linear.weight[:, cols]  # (D, |cols|)
    if out is None:
        return F.linear(x, weight, linear.bias)
    flat = out.view(-1, out.shape[-1])  # (B·L, D): accumulated in place, no (B, L, D) temporary
    # in out's dtype: autocast, which gave the first chunk's product its dtype, does not cover addmm_
    flat.addmm_(x.reshape(-1, x.shape[-1]).to(out.dtype), weight.t().to(out.dtype))
    return out


def _decode_groups(n_heads: int, batch: int, device: torch.device) -> int:
    """Work items per sequence for a decode step over the shared latent. torch's CPU kernel gives
    each (sequence, group) one thread: as many groups as threads per sequence (one group leaves
    the other threads idle; one per head reads the cache H times, slower even single-threaded).
    Elsewhere one per head, as for GQA (not measured here)."""
    if device.type != "cpu":
        return n_heads
    most = max(1, _cpu_threads() // batch)
    return max(g for g in range(1, min(n_heads, most) + 1) if n_heads % g == 0)


@torch.compiler.assume_constant_result
def _cpu_threads() -> int:
    """torch's intra-op thread count. A constant to torch.compile, which cannot put the int that
    `torch.get_num_threads()` returns in a graph (a graph break in every decode step, an error with
    fullgraph=True): a compiled decode step keeps the grouping it was traced with (the same values)."""
    return torch.get_num_threads()


def _same_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Zero-pad q, k or v to one head dim (r_K != r_V): torch's fused CPU kernel needs it, else
    SDPA falls back to its math backend and its (B, H, L, S) scores. Zero dims add nothing to
    a score, and padded value dims are sliced off the output."""
    e, f = k.shape[-1], v.shape[-1]
    if e < f:
        return F.pad(q, (0, f - e)), F.pad(k, (0, f - e)), v  # k still (B, 1, S, ·): padded once, not per head
    if f < e:
        return q, k, F.pad(v, (0, e - f))
    return q, k, v


def merge_heads(out: Tensor, value_dim: int) -> Tensor:
    """Attention outputs (B, H, L, e) -> (B, L, H·f): each head's first f = `value_dim` dims (the
    others, where e > f, are the zero-padded value latent's, `_same_head_dim`)."""
    if out.shape[-1] == value_dim:
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    return merged_value_heads(out, value_dim)


@torch.library.custom_op("convert::merged_value_heads", mutates_args=())
def merged_value_heads(out: Tensor, value_dim: int) -> Tensor:
    """`merge_heads` of a padded output (e > f), a new contiguous tensor, as one operator (forward
    and backward) that torch.compile runs as it is: compressed layers' widths differ, and traced,
    this copy and its gradient gave every layer its own generated kernels (bench/train_step.py)."""
    batch, n_heads, length, _ = out.shape
    merged = out.new_empty(batch, length, n_heads, value_dim)
    merged.copy_(out[..., :value_dim].transpose(1, 2))  # (B, L, H, f)
    return merged.view(batch, length, n_heads * value_dim)


@merged_value_heads.register_fake
def _merged_value_heads_shape(out, value_dim):
    return out.new_empty(out.shape[0], out.shape[2], out.shape[1] * value_dim)


@torch.library.custom_op("convert::merged_value_heads_backward", mutates_args=())
def merged_value_heads_backward(grad: Tensor, n_heads: int, width: int) -> Tensor:
    """The gradient of `merged_value_heads`: grad (B, L, H·f) -> (B, H, L, e = `width`), zero past f."""
    batch, length, features = grad.shape
    value_dim = features // n_heads
    out = grad.new_zeros(batch, n_heads, length, width)
    out[..., :value_dim] = grad.reshape(batch, length, n_heads, value_dim).transpose(1, 2)
    return out


@merged_value_heads_backward.register_fake
def _merged_value_heads_backward_shape(grad, n_heads, width):
    return grad.new_empty(grad.shape[0], n_heads, grad.shape[1], width)


def _save_widths(ctx, inputs, output) -> None:
    ctx.n_heads, ctx.width = inputs[0].shape[1], inputs[0].shape[-1]  # H, e


def _merged_grad(ctx, grad):
    return merged_value_heads_backward(grad, ctx.n_heads, ctx.width), None


def _save_value_dim(ctx, inputs, output) -> None:
    ctx.value_dim = inputs[0].shape[-1] // inputs[1]


def _merged_backward_grad(ctx, grad):  # the padding's transpose: the slice, merged
    return merged_value_heads(grad, ctx.value_dim), None, None


merged_value_heads.register_autograd(_merged_grad, setup_context=_save_widths)
merged_value_heads_backward.register_autograd(_merged_backward_grad, setup_context=_save_value_dim)


def causal_mask(length: int, total: int, like: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Additive (L, S) causal mask for the last L of S positions (and a sliding window, as
    transformers builds it: a query sees itself and the window − 1 keys before it)."""
    offset = total - length
    allowed = torch.ones(length, total, dtype=torch.bool, device=like.device).tril(offset)
    if window is not None:
        allowed &= ~torch.ones_like(allowed).tril(offset - window)
    return torch.zeros(length, total, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))


def attend_eager(q, k, v, attention_mask, scaling: float, softcap, causal: bool, window, zero_empty: bool = False):
    """Attention through explicit (B, H, L, S) scores (scaled, soft-capped by `softcap`, masked by
    `attention_mask` or, `causal`, by a causal mask over `window`): the output (B, H, L, f) and the weights (B, H, L, S); a fully
    masked row (boolean mask) gives NaN, or zeros with `zero_empty` (as SDPA does)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (B, H, L, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : k.shape[-2]], float("-inf"))
    elif attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]]
    elif causal and q.shape[-2] > 1:
        scores = scores + causal_mask(q.shape[-2], k.shape[-2], scores, window)
    # float32 at least, as transformers does for half precision; float64 stays float64
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    if zero_empty and attention_mask is not None and attention_mask.dtype == torch.bool:
        probs = probs.masked_fill(~attention_mask[..., : k.shape[-2]].any(-1, keepdim=True), 0.0)
    return torch.matmul(probs, v), probs  # (B, H, L, f), (B, H, L, S)


def attend_sdpa(q, k, v, attention_mask, scaling: float, causal: bool, window):
    """`attend_eager`'s output through SDPA, without soft-capping (same masks; a fully masked row
    gives 0, not NaN), its heads merged: (B, L, H·f) (`merge_heads`).

    The latent (k.shape[1] == 1) is shared by all heads and never copied per head: a
    decode step folds the heads into the query length (few passes over the cache); a
    prefill expands it over heads as a stride-0 view, which torch's fused CPU kernel
    reads in place (`enable_gqa` would do the same but needs torch >= 2.5). Masks
    broadcast over heads: at most (B, 1, L, S), never (B, H, L, S).
    """
    n_heads, length, seq = q.shape[1], q.shape[2], k.shape[-2]
    mask, top_left = attention_mask, False
    if mask is not None:
        mask = mask[..., :seq]
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # SDPA takes an additive mask in the query's dtype only
    elif causal and length > 1:
        if length == seq and window is None:
            top_left = True  # SDPA's causal mask is top-left aligned: right only without cached keys
        else:
            mask = causal_mask(length, seq, q, window)  # (L, S)
    value_dim = v.shape[-1]
    if k.shape[1] != n_heads and length == 1:
        return merge_heads(_decode_shared_latent(q, k, v, mask, scaling), value_dim)
    q, k, v = _same_head_dim(q, k, v)
    if k.shape[1] != n_heads:
        k, v = k.expand(-1, n_heads, -1, -1), v.expand(-1, n_heads, -1, -1)  # stride-0 views
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=top_left, scale=scaling)  # (B, H, L, e)
    return merge_heads(out, value_dim)  # (B, L, H·f)


def _decode_shared_latent(q, k, v, mask, scaling: float):
    """One query per head against the shared latent: the heads folded into the query length
    of `groups` work items, each reading the cache once (MQA) instead of once per head."""
    batch, n_heads = q.shape[:2]
    groups = _decode_groups(n_heads, batch, q.device)
    q = q.reshape(batch, groups, n_heads // groups, q.shape[-1])  # (B, g, H/g, e)
    k, v = k.expand(-1, groups, -1, -1), v.expand(-1, groups, -1, -1)  # (B, g, S, ·), stride-0 views
    if mask is not None and mask.dim() == 4:
        mask = mask.expand(-1, n_heads, -1, -1)  # (B|1, H, 1, S), a view
        mask = mask.reshape(mask.shape[0], groups, n_heads // groups, -1)  # (B|1, g, H/g, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # (B, g, H/g, f)
    return out.reshape(batch, n_heads, 1, -1)  # (B, H, 1, f)
