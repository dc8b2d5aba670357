"""One layer's export tensors: the position-free keys and the values factored into the latent
(exact at the content's rank, compressed below it), the rotary key, the scaled query and output."""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from convert.arch import AttentionSpec
from convert.compress.weights import ridge, shrunk
from convert.linalg.factor import Factor
from convert.linalg.heads import group_of_head
from convert.linalg.weighted import psd_sqrt, weighted_factor
from convert.targets.vllm.bias import BiasCarrier
from convert.targets.vllm.geometry import (
    KV_LORA_RANK,
    LATENT_DIMS,
    NORM_BIAS,
    NORM_EPS,
    ROPE_DIM,
    latent_content_rank,
)
from convert.targets.vllm.nope_fit import rotary_coefficients
from convert.targets.vllm.rotary import rotary_key_weights, rotate_half_pairs
from convert.transform import LayerWeights

if TYPE_CHECKING:
    from convert.compress.calibrate import LayerStats
    from convert.compress.sequential import SequentialStats


@dataclass(frozen=True)
class LatentFit:
    """How one layer's latent is factored (`latent_factor`): the dims it may use (at most
    `LATENT_DIMS`), the layer's calibration statistics (`convert.compress.calibrate`'s `LayerStats`,
    with the Fisher rows when calibrated for them) and sequential calibration's `SequentialStats` of
    the layer (the compressed model's inputs; None: the original's); `shrinkage`: --shrinkage, the
    Fisher information and the original's input moment pulled toward isotropic ones (`shrunk`);
    `rope_dim`: the rotary key's width (`latent_content_rank`)."""

    rank: int = LATENT_DIMS
    layer_stats: "LayerStats | None" = None
    inputs: "SequentialStats | None" = None
    shrinkage: float = 0.0
    rope_dim: int = ROPE_DIM


def latent_factor(
    remainder: torch.Tensor, value: torch.Tensor, spec: AttentionSpec, fit: LatentFit = LatentFit()
) -> tuple[Factor, bool]:
    """The latent's down-projection and the keys' and values' up-projections: a factor of
    [r; W^V] (2·G·d, D). (factor, compressed): exact (plain SVD at the content's rank) when
    `latent_content_rank` fits in `fit.rank`; otherwise the compression module's best rank-`fit.rank`
    factor (`weighted_factor`: M-whitened, rows weighted by the key and value Fisher
    information when the stats carry it — loss units, so keys and values share the budget).
    With `fit.inputs` M is the compressed model's inputs' and the up-projections are refit to the
    original layer's outputs; else M is the original's."""
    rank, layer_stats, inputs = fit.rank, fit.layer_stats, fit.inputs
    content = torch.cat([remainder, value.double()])  # (2·G·d, D)
    need = min(latent_content_rank(spec, fit.rope_dim), content.shape[1])
    if need <= rank:
        return weighted_factor(content, need), False
    row_weight, alpha = None, fit.shrinkage
    key_fisher = getattr(layer_stats, "key_fisher", None)
    if key_fisher is not None:
        assert layer_stats is not None and layer_stats.value_fisher is not None  # gathered with key_fisher
        row_weight = torch.block_diag(
            psd_sqrt(ridge(shrunk(key_fisher.double(), alpha))),
            psd_sqrt(ridge(shrunk(layer_stats.value_fisher.double(), alpha))),
        )
    if inputs is not None:  # measured in the compressed model, beside the cross moment it is solved with
        return weighted_factor(content, rank, row_weight, moment=inputs.moment, cross=inputs.cross), True
    moment = shrunk(layer_stats.moment, alpha) if layer_stats is not None else None
    return weighted_factor(content, rank, row_weight=row_weight, moment=moment), True


def attention_tensors(
    w: LayerWeights,
    spec: AttentionSpec,
    u: torch.Tensor,
    q_scale: float,
    s: float,
    stand_in: torch.Tensor | None = None,
    latent: LatentFit = LatentFit(),
    carrier: BiasCarrier | None = None,
    key_bias_slots: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """One layer's DeepseekV3Attention tensors (float64), by name relative to `self_attn.`, and
    whether its latent is compressed (`latent_factor`).

    u (rope_dim/2, G·f): the rotary directions (`rotary_directions`; rope_dim 64 in vLLM). stand_in (H, 2, d/2, 2): for head
    h and pair j, [h, 0, j] the (α, β) of its position-free (NoPE) terms, which stand in for the
    dropped rotation as q_hᵀ [[α, β], [-β, α]] r, and [h, 1, j] the (α', β') of the map added to
    its rotary query (`convert.targets.vllm.nope_fit`); default the terms unrotated, nothing added.
    latent: how the latent is factored (`latent_factor`); of the 512 dims those it does not use
    are zero but the norm's constant rows (`NORM_ROWS`). carrier: how the q/k/v biases ride in the
    weights (`convert.targets.vllm.bias`); required with biases. key_bias_slots (rope_dim/2,) bool: the rotary
    slots a key bias is carried in (`convert.targets.vllm.bias.key_bias_slots`; default none)."""
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    hidden = w.q.shape[1]
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    rope_dim = 2 * u.shape[0]
    if carrier is None and any(b is not None for b in (w.q_bias, w.k_bias, w.v_bias)):
        raise ValueError("q/k/v biases need a BiasCarrier (calibration statistics) to be carried")
    q = carrier.carry(w.q, w.q_bias).reshape(H, d, hidden) if carrier else w.q.double().reshape(H, d, hidden)
    k0, remainder = rotary_key_weights(w.k, spec, u)  # (rope_dim, D), (G·d, D)
    if carrier is not None and w.k_bias is not None:  # the bias's position-free share is left out (BiasCarrier)
        half = rope_dim // 2
        slots = key_bias_slots if key_bias_slots is not None else torch.zeros(half, dtype=torch.bool)
        carried = rotary_key_weights(carrier.carry(w.k, w.k_bias), spec, u)[0]
        k0 = k0.clone()
        k0[:half][slots] = carried[:half][slots]  # first halves of the slots that turn
        k0[half:][slots] = carried[half:][slots]  # second halves
    value = carrier.carry(w.v, w.v_bias) if carrier else w.v

    q_nope, q_pe = _queries(q, u, spec, stand_in)  # (H, d, D), (H, rope_dim, D)
    k_pe = torch.stack([k0[: rope_dim // 2], k0[rope_dim // 2 :]], dim=1).reshape(rope_dim, hidden)
    factor, compressed = latent_factor(remainder, value, spec, latent)
    down, kv_b = _latent_maps(factor, spec, groups, hidden)  # (512, D), (H, 2d, 512)
    latent_bias = torch.zeros(KV_LORA_RANK + rope_dim, dtype=torch.float64)
    latent_bias[LATENT_DIMS:KV_LORA_RANK] = NORM_BIAS  # transformers' stand-in for the eps (`NORM_ROWS`)
    norm_weight = torch.full((KV_LORA_RANK,), math.sqrt(NORM_EPS), dtype=torch.float64)
    norm_weight[LATENT_DIMS:] = 0.0
    tensors = {
        "q_proj.weight": (q_scale * torch.cat([q_nope, q_pe], dim=1)).reshape(H * (d + rope_dim), hidden),
        "kv_a_proj_with_mqa.weight": torch.cat([down, k_pe]),  # (512 + rope_dim, D)
        "kv_a_proj_with_mqa.bias": latent_bias,  # (512 + rope_dim,): read by transformers only
        "kv_a_layernorm.weight": norm_weight,
        "kv_b_proj.weight": kv_b.reshape(H * 2 * d, KV_LORA_RANK),
        "o_proj.weight": s * w.o.double(),  # (D, H·d)
        "o_proj.bias": torch.zeros(hidden, dtype=torch.float64),  # attention_bias asks for it; vLLM skips it
    }
    return tensors, compressed


def _queries(
    q: torch.Tensor, u: torch.Tensor, spec: AttentionSpec, stand_in: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope (H, d, D) in W^Q's row layout, q_pe (H, rope_dim, D) interleaved (2s, 2s+1)) of the query
    weights q (H, d, D): the position-free terms through the stand-in's (α, β) map, the rotary
    query the rotary mixture's coefficients plus the stand-in's (α', β') map, folded per slot."""
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    slots, hidden = u.shape[0], q.shape[2]
    f = d // 2 // slots  # source pairs per rotary slot
    first, second = rotate_half_pairs(d)
    if stand_in is None:
        stand_in = torch.zeros(H, 2, d // 2, 2, dtype=torch.float64)
        stand_in[:, 0, :, 0] = 1.0  # unrotated
    alpha, beta, alpha_pe, beta_pe = (stand_in[:, i, :, j].double()[..., None] for i in (0, 1) for j in (0, 1))
    base = rotary_coefficients(u, group_of_head(H, G, spec.head_map), G)[..., None]  # (H, d/2, 1)
    # a map [[α, β], [-β, α]] on the query side of qᵀ M k: Mᵀq = (α q1 - β q2, β q1 + α q2) for pair (q1, q2)
    q1, q2 = q[:, first], q[:, second]  # (H, d/2, D)
    pe_first = ((base + alpha_pe) * q1 - beta_pe * q2).reshape(H, slots, f, hidden).sum(2)  # (H, slots, D)
    pe_second = (beta_pe * q1 + (base + alpha_pe) * q2).reshape(H, slots, f, hidden).sum(2)
    q_pe = torch.stack([pe_first, pe_second], dim=2).reshape(H, 2 * slots, hidden)  # interleaved (2s, 2s+1)
    q_nope = torch.cat([alpha * q1 - beta * q2, beta * q1 + alpha * q2], dim=1)  # (H, d, D), W^Q's row layout
    return q_nope, q_pe


def _latent_maps(
    factor: Factor, spec: AttentionSpec, groups: torch.Tensor, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latent's down-projection (512, D), kv_b (H, 2d, 512)) from the latent's factor: the dims
    it does not use are zero; head h reads its group's key remainder and values."""
    G, d = spec.n_kv_heads, spec.head_dim
    used = factor.down.shape[0]
    latent = torch.zeros(KV_LORA_RANK, hidden, dtype=torch.float64)
    latent[:used] = factor.down
    up = torch.zeros(2, G, d, KV_LORA_RANK, dtype=torch.float64)
    up[..., :used] = factor.up.reshape(2, G, d, used)  # [keys' remainder | values] per group
    return latent, torch.cat([up[0, groups], up[1, groups]], dim=1)
