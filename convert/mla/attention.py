"""The runnable MLA attention: `MLAAttention`, a drop-in for a transformers attention module.

Two layouts over the same cached latent (docs/math.md, "Absorption" and "RoPE"): absorbed (MQA with head dim r over
the latent) and factored (keys and values up-projected per head at run time, then the source's RoPE).
"""

import torch
from torch import nn

from convert.linalg.rope_factor import latent_groups, latent_ungroup
from convert.mla.config import LayerEntry, MLASection
from convert.mla.kernels import attend_eager, attend_sdpa, cols, linear_cols_add, linear_rows, merge_heads, sliceable
from convert.mla.latent_rope import cached_positions, latent_rope
from convert.rope.rotation import apply_rope


class QKNorm(nn.Module):
    """The source's q/k RMSNorm over the last dim, computed as transformers computes it: in
    float32, then the weight applied in the input's dtype (Qwen3RMSNorm), or in float32
    before casting back (`weight_in_float32`, Olmo2RMSNorm), or (1 + weight) in float32
    (`unit_offset`, Gemma3RMSNorm, whose weight is stored as its offset from one)."""

    def __init__(self, dim: int, eps: float, weight_in_float32: bool = False, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.weight_in_float32, self.unit_offset = eps, weight_in_float32 or unit_offset, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight_in_float32:
            return (self.weight * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


class MLAAttention(nn.Module):
    """MLA attention converted from a GQA layer; same call signature as HF attention.

    layer: this layer's entry of config.json `mla.layers` (ranks, key_freq_index,
    bias), mla: the `mla` section (layout, latent, n_heads, head_dim, …).

    The cache (a transformers `Cache`) holds latents only: keys (B, 1, S, r_K), values (B, 1, S, r_V)
    (joint: the key latent serves both), and in the factored layout with RoPE each token's position.
    Attention runs through SDPA; explicit scores ("eager") only for soft-capping.
    """

    def __init__(
        self,
        hidden_size: int,
        mla: MLASection,
        layer: LayerEntry,
        layer_idx: int,
        rotary=None,
        causal: bool = True,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window  # used only when no mask is passed in
        self.layout, self.joint = mla.layout, mla.joint
        self.n_heads, self.head_dim = mla.n_heads, mla.head_dim
        self.scaling = mla.softmax_scale
        self.softcap = mla.softcap  # Gemma 2: scores -> cap·tanh(scores/cap), before the mask
        # "sdpa" (torch's fused kernels) or "eager" (explicit scores: the reference, and soft-capping)
        self.attn_impl = "sdpa"
        self.rope = mla.has_rope
        self.is_causal = causal
        self.rank_k, self.rank_v = layer.key_rank, layer.value_rank
        self.qk_norm = mla.qk_norm  # None, "head" (per head) or "whole" (the whole projection)
        self.n_kv_heads = mla.n_kv_heads
        bias = set(layer.bias)
        self._latent_maps(hidden_size, bias)
        if self.qk_norm:
            assert mla.norm_eps is not None  # written with qk_norm (`convert.mla.format`), checked with it
            self._normed_maps(hidden_size, bias, mla.norm_eps, mla.norm_unit_offset)
        if self.layout == "absorbed":
            self._absorbed_maps(hidden_size, bias, layer.key_freq_index or ())
        else:
            self._factored_maps(hidden_size, bias)
        # The source model's rotary embedding, shared and not a submodule: the
        # factored layout needs cos/sin of cached positions.
        object.__setattr__(self, "rotary", rotary)

    def _latent_maps(self, hidden_size: int, bias: set[str]) -> None:
        """The down-projections to the cached latents (joint: one)."""
        rank_k, rank_v = self.rank_k, self.rank_v
        if self.joint:
            self.kv_down = nn.Linear(hidden_size, rank_k, bias=False)
            return
        keys = self.n_kv_heads * self.head_dim
        # q/k norm, compressed: the norm runs on every KV head's key, then `k_compress` caches r_K dims
        compressed_norm = self.qk_norm is not None and rank_k < keys
        self.k_down = nn.Linear(hidden_size, keys if compressed_norm else rank_k, bias="k_down" in bias)
        self.k_compress = nn.Linear(keys, rank_k, bias=False) if compressed_norm else None
        self.v_down = nn.Linear(hidden_size, rank_v, bias=False)

    def _normed_maps(self, hidden_size: int, bias: set[str], eps: float, offset: bool) -> None:
        """With a q/k norm: the live query, the norms, and the key up-projection they need."""
        inner = self.n_heads * self.head_dim
        whole = self.qk_norm == "whole"  # OLMo 2, whose norm also applies its weight in float32
        self.q_proj = nn.Linear(hidden_size, inner, bias="q_proj" in bias)
        self.q_norm = QKNorm(inner if whole else self.head_dim, eps, whole, offset)  # offset: Gemma 3's (1 + weight)
        k_dim = self.n_kv_heads * self.head_dim if whole else self.head_dim
        self.k_norm = QKNorm(k_dim, eps, whole, offset)
        self.k_up = nn.Linear(self.rank_k, inner, bias=False)

    def _absorbed_maps(self, hidden_size: int, bias: set[str], key_freq_index: tuple[int, ...]) -> None:
        """The absorbed layout: queries and outputs over the latent, and the latent pairs' frequencies."""
        if not self.qk_norm:
            self.q_absorbed = nn.Linear(hidden_size, self.n_heads * self.rank_k, bias="q_absorbed" in bias)
        self.o_absorbed = nn.Linear(self.n_heads * self.rank_v, hidden_size, bias="o_absorbed" in bias)
        # Plain data, not a buffer: transformers' loaders re-create buffers they do not
        # find in the checkpoint, and this one is config, not weights.
        self.key_freq_index = key_freq_index
        self._freq_index: dict[torch.device, torch.Tensor] = {}

    def _factored_maps(self, hidden_size: int, bias: set[str]) -> None:
        """The factored layout: per-head queries, keys and values up from the latents, the output."""
        inner = self.n_heads * self.head_dim
        if not self.qk_norm:
            self.q_proj = nn.Linear(hidden_size, inner, bias="q_proj" in bias)
            self.k_up = nn.Linear(self.rank_k, inner, bias=False)
        self.v_up = nn.Linear(self.rank_v, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias="o_proj" in bias)

    def freq_index(self, device: torch.device) -> torch.Tensor:
        """The source frequency of each key-latent pair (P,), as a tensor on `device`."""
        if device not in self._freq_index:
            self._freq_index[device] = torch.tensor(self.key_freq_index, dtype=torch.long, device=device)
        return self._freq_index[device]

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) hidden states -> key latent (B, L, r_K), value latent (B, L, r_V)."""
        if self.joint:
            c = self.kv_down(x)
            return c, c
        c_k = self.k_down(x)
        if self.qk_norm:  # the latent's key blocks, normalised as the source normalises the key
            keys = latent_groups(c_k, self.n_kv_heads)  # (B, L, G, d): the source's keys
            if self.qk_norm == "whole":
                keys = self.k_norm(keys.flatten(-2)).unflatten(-1, keys.shape[-2:])  # over all G·d dims
            else:
                keys = self.k_norm(keys)  # per head
            c_k = latent_ungroup(keys)
            if self.k_compress is not None:
                c_k = self.k_compress(c_k)  # (B, L, r_K): the normed keys, compressed
        return c_k, self.v_down(x)

    def _query_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> per-head queries (B, H, L, d) (normalised per head with a q norm)."""
        batch, length, _ = x.shape
        q = self.q_proj(x)  # (B, L, H·d)
        if self.qk_norm == "whole":
            q = self.q_norm(q)
        q = q.view(batch, length, self.n_heads, self.head_dim)  # (B, L, H, d)
        if self.qk_norm == "head":
            q = self.q_norm(q)
        return q.transpose(1, 2)

    def _latent_query(self, x: torch.Tensor, heads: slice, q_heads: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, D) -> queries of `heads` over the key latent (B, h, L, r_K): Ŵ^Q x, or with a q norm
        W^UKᵀ applied to the normalised queries `q_heads` (B, H, L, d) at run time."""
        batch, length, _ = x.shape
        if not self.qk_norm:
            rows = cols(heads, self.rank_k)
            q = linear_rows(self.q_absorbed, x, rows, whole=self.n_heads * self.rank_k)  # (B, L, h·r_K)
            return q.view(batch, length, -1, self.rank_k).transpose(1, 2)
        assert q_heads is not None  # `_absorbed` passes them with a q norm
        up = self.k_up.weight.view(self.n_heads, self.head_dim, self.rank_k)[heads]  # (h, d, r_K)
        return torch.einsum("bhld,hdr->bhlr", q_heads[:, heads], up)

    def _head_chunks(self, length: int, weights: bool, per_head: int, budget: int, modules) -> list[slice]:
        """The heads a prefill attends to at once: chunks of at most `budget` // `per_head` heads, so
        that no per-chunk temporary (queries, up-projected keys and values, outputs) is wider than
        the original's (H·d queries, G·d keys). All heads at once for a decode step (L = 1), explicit
        scores (they are (B, H, L, S) anyway), modules that are not plain `nn.Linear` (a PEFT
        adapter, a quantized or an offloaded layer: slicing their weights would bypass them) and a
        module in training mode: autograd keeps every chunk's keys, values and outputs
        for the backward anyway, so there chunks bound no memory and cost kernels and torch.compile
        time (bench/train_step.py); an activation-checkpointed layer's no-grad first pass is taken
        whole as its recompute is. Refinement (`convert.compress.refine`) fits modules in eval mode:
        its steps keep the chunks, and the bytes they give."""
        plain = all(map(sliceable, modules))
        sdpa = self.attn_impl == "sdpa" and self.softcap is None and not weights
        size = max(1, budget // per_head)
        if length == 1 or not sdpa or not plain or self.training or size >= self.n_heads:
            return [slice(0, self.n_heads)]
        return [slice(h, min(h + size, self.n_heads)) for h in range(0, self.n_heads, size)]

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        past_key_values=None,
        cache=None,
        key_states=None,
        key_position_embeddings=None,
        **kwargs,
    ):
        """The attention of `hidden_states` (B, L, D). key_states (B, S, D), with their cos/sin
        `key_position_embeddings`: the hidden states the keys and values come from, where they are
        not the queries' (some positions' queries against a whole window, `convert.compress.refine`;
        no cache, and `attention_mask` (…, L, S) says which keys each query sees)."""
        # the KV cache: `cache` from transformers 5.24 on, `past_key_values` before
        cache = cache if cache is not None else past_key_values
        if key_states is not None and cache is not None:
            raise ValueError("MLAAttention: key_states and a KV cache exclude each other (the cache holds the keys)")
        kv_inputs = (
            (hidden_states, position_embeddings) if key_states is None else (key_states, key_position_embeddings)
        )
        # output_attentions: the (B, H, L, S) weights, as the family's eager attention returns them
        weights = bool(kwargs.get("output_attentions"))
        if self.layout == "absorbed":
            return self._absorbed(hidden_states, position_embeddings, attention_mask, cache, weights, kv_inputs)
        positions = kwargs.get("position_ids")
        return self._factored(hidden_states, position_embeddings, attention_mask, cache, positions, weights, kv_inputs)

    def _attend(self, q, k, v, attention_mask, weights: bool = False):
        """q (B, H, L, e), k (B, 1|H, S, e), v (B, 1|H, S, f) -> (B, L, H·f), and the attention
        weights (B, H, L, S) when `weights` (else None)."""
        # SDPA has no score soft-capping (Gemma 2's cap·tanh(scores/cap)) and returns no weights
        if self.attn_impl == "eager" or self.softcap is not None or weights:
            # explicit scores on SDPA's behalf keep its zeros for a query that may see no key: NaN
            # there (a left-padded query, boolean mask) would reach every later layer through its values
            zero_empty = self.attn_impl != "eager"
            out, probs = attend_eager(
                q, k, v, attention_mask, self.scaling, self.softcap, self.is_causal, self.sliding_window, zero_empty
            )  # (B, H, L, f), (B, H, L, S)
            return merge_heads(out, out.shape[-1]), (probs if weights else None)  # (B, L, H·f)
        return attend_sdpa(q, k, v, attention_mask, self.scaling, self.is_causal, self.sliding_window), None

    def _absorbed(self, x, position_embeddings, attention_mask, cache, weights: bool, kv_inputs: tuple):
        c_k, c_v = self.latents(kv_inputs[0])  # (B, S, r_K), (B, S, r_V)
        if self.rope:
            cos, sin = position_embeddings  # (B, L, d): the source's, gathered by `latent_rope`
            c_k = latent_rope(c_k, *kv_inputs[1], self.freq_index(x.device))  # the keys' (B, S, r_K)
        k, v = c_k[:, None], c_v[:, None]  # (B, 1, L, r)
        if cache is not None:
            k, v = self._update_cache(cache, k, v)
            k, v = self._static_prefill(cache, attention_mask, k, v, x.shape[1])
        q_heads = self._query_heads(x) if self.qk_norm else None  # (B, H, L, d)
        queries = self.k_up if self.qk_norm else self.q_absorbed
        width = self.n_heads * self.head_dim // 2  # half the original's queries: its RoPE holds four such
        rotary = (cos[:, None], sin[:, None]) if self.rope else None
        out = probs = None
        for heads in self._head_chunks(x.shape[1], weights, self.rank_k, width, (queries, self.o_absorbed)):
            o, probs = self._attend(self._rotated_query(x, heads, q_heads, rotary), k, v, attention_mask, weights)
            out = linear_cols_add(self.o_absorbed, o, cols(heads, self.rank_v), self.n_heads * self.rank_v, out)
            del o  # (B, L, h·r_V): not held through the next chunk's attention
        return out, probs

    def _rotated_query(self, x, heads: slice, q_heads, rotary) -> torch.Tensor:
        """The latent queries of `heads` (B, h, L, r_K), rotated when `rotary` (the source's cos,
        sin (B, 1, L, d)) is given."""
        q = self._latent_query(x, heads, q_heads)
        return latent_rope(q, *rotary, self.freq_index(x.device)) if rotary is not None else q

    def _static_prefill(self, cache, attention_mask, k, v, length: int):
        """k, v (B, ·, S, ·) as this call attends to them: the first `length` slots where transformers
        passes no mask for `length` > 1 queries against more slots of a static cache layer. It does so
        only for a prefill into an empty static cache, leaving SDPA's top-left `is_causal` to keep the
        empty slots out (its own SDPA attention slices the keys the same way); our causal mask without
        a mask is bottom-right aligned (queries after the cached keys, as a dynamic cache holds them),
        which would let every query attend to the empty slots."""
        if attention_mask is not None or length == 1 or k.shape[-2] <= length:
            return k, v
        if not getattr(cache.layers[self.layer_idx], "is_compileable", False):  # a dynamic layer: keys, no slots
            return k, v
        return k[..., :length, :], v[..., :length, :]

    def _update_cache(self, cache, k, v):
        if not self.joint:
            return cache.update(k, v, self.layer_idx)
        k, _ = cache.update(k, k[..., :0], self.layer_idx)  # joint: one latent serves both
        return k, k

    def _factored(self, x, position_embeddings, attention_mask, cache, positions, weights: bool, kv_inputs: tuple):
        q = self._query_heads(x)  # (B, H, L, d)
        c_k, c_v = self.latents(kv_inputs[0])  # (B, S, r_K), (B, S, r_V)
        c_k, c_v = c_k[:, None], c_v[:, None]  # (B, 1, L, r)
        if cache is not None:
            c_k, c_v = self._update_cache(cache, c_k, c_v)
            c_k, c_v = self._static_prefill(cache, attention_mask, c_k, c_v, x.shape[1])  # up-project no empty slot
        seq = c_k.shape[-2]
        if self.rope:
            cos, sin = position_embeddings  # (B, L, d)
            q = apply_rope(q, cos[:, None], sin[:, None])
            k_cos, k_sin = self._key_cos_sin(cache, kv_inputs[1], positions, x)  # (B, ≥S, d): every slot
            k_cos, k_sin = k_cos[:, None, :seq], k_sin[:, None, :seq]
        keys = self.n_kv_heads * self.head_dim  # the original's keys (and values) per token
        modules = (self.k_up, self.v_up, self.o_proj)
        out = probs = None
        for heads in self._head_chunks(x.shape[1], weights, self.head_dim, keys, modules):
            k, v = self._keys_values(c_k[:, 0], c_v[:, 0], heads, (k_cos, k_sin) if self.rope else None)
            o, probs = self._attend(q[:, heads], k, v, attention_mask, weights)
            out = linear_cols_add(self.o_proj, o, cols(heads, self.head_dim), self.n_heads * self.head_dim, out)
            del k, v, o  # (B, h, S, d), (B, L, h·d): not held through the next chunk's
        return out, probs

    def _keys_values(self, c_k, c_v, heads: slice, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (B, S, r) -> the keys and values of `heads` (B, h, S, d), keys rotated when `rotary`."""
        batch, seq = c_k.shape[:2]
        rows, whole = cols(heads, self.head_dim), self.n_heads * self.head_dim
        k = linear_rows(self.k_up, c_k, rows, whole).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = linear_rows(self.v_up, c_v, rows, whole).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        return (apply_rope(k, *rotary) if rotary is not None else k), v

    def _key_cos_sin(self, cache, position_embeddings, positions, x):
        """cos/sin (B, S, d) of the S keys this call attends to: the call's own without cached keys,
        else those of the positions a twin of the cache layer keeps beside the latents."""
        if cache is None:
            return position_embeddings
        if self.rotary is None or positions is None:
            raise RuntimeError("the factored RoPE layout needs position_ids and the model's rotary embedding to decode")
        key_positions = cached_positions(cache.layers[self.layer_idx], positions.expand(x.shape[0], -1))  # (B, S)
        return self.rotary(x, key_positions)


def build_mla_attention(
    mla: MLASection,
    layer: int,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    rotary=None,
    sliding_window: int | None = None,
    dtype: torch.dtype | None = None,
) -> MLAAttention:
    """Layer `layer`'s MLAAttention from the `mla` config section, with its converted tensors.

    tensors: names relative to the layer's prefix (`k_down.weight`, …), loaded
    strictly; None leaves the weights uninitialised. dtype: default the tensors'.
    """
    module = MLAAttention(
        mla.hidden_size,
        mla,
        mla.layers[layer],
        layer,
        rotary=rotary,
        causal=mla.causal,
        sliding_window=sliding_window,
    )
    dtype = dtype or (next(iter(tensors.values())).dtype if tensors else None)
    # Cast before loading: load_state_dict copies into the parameters' dtype, so
    # float64 tensors loaded into float32 parameters would be silently rounded.
    module = module.to(dtype) if dtype is not None else module
    if tensors is not None:
        module.load_state_dict(tensors, strict=True)
    return module.eval()


def layer_tensors(state: dict[str, torch.Tensor], mla: MLASection, layer: int) -> dict[str, torch.Tensor]:
    """One layer's converted tensors out of a whole state dict, named relative to its prefix."""
    prefix = mla.prefix(layer)
    return {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
