"""The one shape vLLM's MLA kernels serve: a 512-dim latent and one 64-dim rotary key shared by every
head, and the latent norm made linear (`NORM_ROWS`)."""

import torch

from convert.arch import AttentionSpec
from convert.rope.frequencies import fold

KV_LORA_RANK = 512
ROPE_DIM = 64
NORM_EPS = 2.0**40  # rms_norm_eps of the export: the latent norm is linear
#: The latent's last NORM_ROWS dims hold, in `kv_a_proj_with_mqa.bias`, the constant NORM_BIAS and
#: nothing else (zero weight rows, zero norm weight, zero kv_b_proj columns). vLLM builds that Linear
#: without a bias and skips the tensor, so it reads zeros there and its latent norm's eps (rms_norm_eps)
#: makes the norm linear; stock transformers, whose DeepseekV3 hard-codes that eps to 1e-6, adds the
#: bias (`attention_bias: true`), and the rows' mean square NORM_ROWS·NORM_BIAS²/512 = 2^40 = NORM_EPS
#: does the same: both compute one model, exactly in bfloat16 too (2^24 is exact).
NORM_ROWS = 2
NORM_BIAS = 2.0**24
LATENT_DIMS = KV_LORA_RANK - NORM_ROWS  # latent dims the export may use
assert NORM_ROWS * NORM_BIAS**2 / KV_LORA_RANK == NORM_EPS
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def cache_values_per_layer(rope_dim: int = ROPE_DIM) -> int:
    """What vLLM caches per token per layer: the latent and the shared rotary key."""
    return KV_LORA_RANK + rope_dim


def latent_content_rank(spec: AttentionSpec, rope_dim: int = ROPE_DIM) -> int:
    """Dims the latent needs to hold the position-free keys and the values exactly:
    rope_dim·(G·f − 1) remainder dims (each slot's components less its rotary key) + G·d values."""
    return rope_dim * (spec.n_kv_heads * fold(spec.head_dim, rope_dim) - 1) + spec.n_kv_heads * spec.head_dim


def needs_compression(spec: AttentionSpec, hidden: int, rank: int = LATENT_DIMS, rope_dim: int = ROPE_DIM) -> bool:
    """The position-free keys and the values need more than the latent's `rank` dims (7B+: G·d large)."""
    return min(latent_content_rank(spec, rope_dim), hidden) > rank


def vllm_geometry(spec: AttentionSpec, rope_dim: int = ROPE_DIM) -> dict:
    """Head dims of the export: nope (each head's own position-free key: its group's remainder,
    d dims), rope, v."""
    return {"nope": spec.head_dim, "rope": rope_dim, "v": spec.head_dim}
