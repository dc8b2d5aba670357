"""One layer's DeepSeek-V3 attention tensors from the source GQA weights (`attention_tensors`):
the geometry, the query placement and value expansion by head map, and the neutralized latent norm
(docs/design.md, "Deployment targets")."""

import math
from dataclasses import dataclass

import torch

from convert.linalg.heads import group_of_head
from convert.transform import LayerWeights

# k of the latent-norm constant M = √n·2^k, by checkpoint dtype (docs/design.md, "Deployment targets").
NORM_EXPONENT = {torch.float32: 40, torch.float64: 40, torch.bfloat16: 20}


@dataclass(frozen=True)
class DeepseekGeometry:
    """The DeepseekV3 attention that holds a GQA layer exactly.

    rope_dim R = G·d (qk_rope_head_dim); kv_lora_rank n ≥ R + 1 and q_lora_rank
    m ≥ H·d + 1 (None: no query bias, plain q_proj) are perfect squares; q_scale c
    is the source's softmax scale over DeepSeek's; norm_exponent k.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None
    q_scale: float
    norm_exponent: int

    @property
    def rope_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def interleave_rows(n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Source row of each DeepSeek rotary row, (G·d,) long.

    rotate_half pairs (g·d + j, g·d + j + d/2) with frequency j; DeepSeek's interleaved
    layout pairs rows (2p, 2p+1), p = g·d/2 + j, with the p-th inverse frequency.
    """
    half = head_dim // 2
    first = (torch.arange(n_kv_heads)[:, None] * head_dim + torch.arange(half)[None, :]).reshape(-1)  # (G·d/2,)
    return torch.stack([first, first + half], dim=1).reshape(-1)  # (G·d,)


def square_width(needed: int, dtype: torch.dtype) -> int:
    """The smallest perfect square n = s² ≥ needed whose root s is exact in `dtype` (so M = s·2^k is)."""
    s = math.isqrt(needed - 1) + 1
    while float(torch.tensor(float(s), dtype=dtype)) != s:
        s += 1
    return s * s


def norm_constant(width: int, exponent: int) -> float:
    """M = √n·2^k: with it in one of n dims, mean(x²) = 2^(2k) + (the rest)/n."""
    return math.isqrt(width) * 2.0**exponent


def neutralized_latent(weight: torch.Tensor, bias: torch.Tensor | None, width: int, exponent: int):
    """A Linear + DeepseekV3RMSNorm pair that passes `weight·x + bias` through unchanged.

    weight (r, D), bias (r,) -> proj weight (n, D), proj bias (n,), norm weight (n,):
    rows [0, r) carry the input, the last row the constant M = √n·2^k, the rest zero.
    """
    rows, hidden = weight.shape
    proj_w = torch.zeros(width, hidden, dtype=torch.float64)
    proj_b = torch.zeros(width, dtype=torch.float64)
    norm_w = torch.zeros(width, dtype=torch.float64)
    proj_w[:rows] = weight.double()
    if bias is not None:
        proj_b[:rows] = bias.double()
    proj_b[-1] = norm_constant(width, exponent)
    norm_w[:rows] = 2.0**exponent
    return proj_w, proj_b, norm_w


def query_placement(geo: DeepseekGeometry, head_map: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each source query row goes: (DeepSeek q rows (H·d,), source q rows (H·d,)), long.

    Head h's R rotary dims are zero except group g(h)'s d-block, which holds q_h in
    interleaved pair order: DeepSeek row h·R + g(h)·d + i <- source row h·d + within[i].
    """
    H, d, R = geo.n_heads, geo.head_dim, geo.rope_dim
    heads = torch.arange(H)[:, None]  # (H, 1)
    groups = group_of_head(H, geo.n_kv_heads, head_map)[:, None]  # (H, 1)
    target = heads * R + groups * d + torch.arange(d)[None, :]  # (H, d)
    source = heads * d + interleave_rows(1, d)[None, :]  # (H, d)
    return target.reshape(-1), source.reshape(-1)


def value_expansion(geo: DeepseekGeometry, head_map: str) -> torch.Tensor:
    """kv_b_proj (H·d, n) float64: head h's values are latent dims [g(h)·d, (g(h)+1)·d)."""
    H, d = geo.n_heads, geo.head_dim
    groups = group_of_head(H, geo.n_kv_heads, head_map)[:, None]  # (H, 1)
    rows = torch.arange(H)[:, None] * d + torch.arange(d)[None, :]  # (H, d)
    expand = torch.zeros(H * d, geo.kv_lora_rank, dtype=torch.float64)
    expand[rows.reshape(-1), (groups * d + torch.arange(d)[None, :]).reshape(-1)] = 1.0
    return expand


def attention_tensors(w: LayerWeights, geo: DeepseekGeometry, head_map: str) -> dict[str, torch.Tensor]:
    """One layer's DeepseekV3Attention tensors (float64), by name relative to `self_attn.`."""
    keys = interleave_rows(geo.n_kv_heads, geo.head_dim)  # (R,)
    hidden = w.q.shape[1]
    q_rows = geo.n_heads * geo.rope_dim
    target, source = query_placement(geo, head_map)  # (H·d,), (H·d,)
    out = {}
    if geo.q_lora_rank is None:
        q_proj = torch.zeros(q_rows, hidden, dtype=torch.float64)  # (H·R, D)
        q_proj[target] = geo.q_scale * w.q.double()[source]
        out["q_proj.weight"] = q_proj
    else:
        q_w, q_b, q_norm = neutralized_latent(w.q, w.q_bias, geo.q_lora_rank, geo.norm_exponent)
        out["q_a_proj.weight"], out["q_a_proj.bias"], out["q_a_layernorm.weight"] = q_w, q_b, q_norm
        q_b_proj = torch.zeros(q_rows, geo.q_lora_rank, dtype=torch.float64)  # (H·R, m): latent dim = source row
        q_b_proj[target, source] = geo.q_scale
        out["q_b_proj.weight"] = q_b_proj
    lat_w, lat_b, lat_norm = neutralized_latent(w.v, w.v_bias, geo.kv_lora_rank, geo.norm_exponent)
    k_pe_w = w.k.double()[keys]  # (R, D)
    k_pe_b = w.k_bias.double()[keys] if w.k_bias is not None else torch.zeros(geo.rope_dim, dtype=torch.float64)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([lat_w, k_pe_w])  # (n + R, D)
    out["kv_a_proj_with_mqa.bias"] = torch.cat([lat_b, k_pe_b])  # (n + R,)
    out["kv_a_layernorm.weight"] = lat_norm  # (n,)
    out["kv_b_proj.weight"] = value_expansion(geo, head_map)  # (H·d, n)
    out["o_proj.weight"] = w.o.double()  # (D, H·d)
    out["o_proj.bias"] = w.o_bias.double() if w.o_bias is not None else torch.zeros(hidden, dtype=torch.float64)
    return out
