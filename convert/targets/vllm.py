"""A DeepSeek-V3 checkpoint in the one shape vLLM's MLA kernels serve (target `vllm`).

vLLM's MLA takes `kv_lora_rank` 512 + `qk_rope_head_dim` 64: one `k_pe` of 64 rotary dims shared by
every head, one frequency set, no attention biases. Per rotary slot the key heads' pairs are mixed
into `k_pe` (`rotary_directions`); the rest of each key loses its rotation, stood in for by fitted
maps (`convert.targets.nope_fit`, via `rotation_fit_observer`), and shares the latent with the values
(`latent_factor`); the latent norm is made linear, in vLLM by its eps and in stock transformers by a
latent bias vLLM skips (`NORM_ROWS`), so both compute one model. `to_vllm_deepseek` / `vllm_export`
build it, `check_vllm_exportable` refuses what vLLM would serve wrongly, `match_vllm_norms` fixes
transformers' latent-norm eps on exports written without that bias. The construction tensor by tensor: docs/design.md, "Deployment targets".
"""

import math
from dataclasses import dataclass, replace

import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from convert import compress
from convert.arch import AttentionSpec
from convert.compress.refine import NO_REFINEMENT, Refinement
from convert.compress.sequential import SequentialCalibration
from convert.compress.weights import ridge
from convert.errors import ConvertError
from convert.hf import hf_config, load_pretrained
from convert.io.reader import dtype_itemsize
from convert.linalg.factor import Factor
from convert.linalg.heads import group_of_head
from convert.linalg.weighted import psd_sqrt, weighted_factor
from convert.plan import resolve_spec
from convert.source import LazyTensors, StateDictSource, check_layer, read_layer
from convert.targets import Build
from convert.targets.deepseek import (
    as_dtype,
    check_deepseek,
    check_exportable,
    deepseek_config_fields,
    export_model,
    export_sizes,
    export_source,
    export_spec,
    exporting,
    pass_through_names,
)
from convert.targets.mla import calibration_ids, progress_bar
from convert.targets.nope_fit import (
    SAMPLES,
    additive_mask,
    attention_probabilities,
    fit_normal_equations,
    fit_rotation_stand_in,
    key_remainder,
    per_pair,
    rope_inv_freq,
    rotary_coefficients,
    rotary_mixture,
    sample_keys,
)
from convert.targets.vllm_bias import (
    BiasCarrier,
    bias_carrier,
    biased_projections,
    observers,
    output_error,
    output_observer,
    output_stats,
)
from convert.transform import LayerWeights

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


def cache_values_per_layer() -> int:
    """What vLLM caches per token per layer: the latent and the shared rotary key."""
    return KV_LORA_RANK + ROPE_DIM


def rotate_half_pairs(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half's pair j: rows (j, j + d/2), each (d/2,) long."""
    half = head_dim // 2
    return torch.arange(half), torch.arange(half) + half


def rotary_direction(cov: torch.Tensor, weight: torch.Tensor, iterations: int = 100) -> torch.Tensor:
    """The unit u (G,) whose mixture uᵀk keeps the most query-weighted score energy.

    Head h's score loses q_h·R((I - uuᵀ)k)_{g(h)} to the dropped rotation; its energy,
    with W = diag(weight) the groups' query energy and C the key covariance, is
    tr(W (I-P) C (I-P)), P = uuᵀ: minimize -uᵀ(CW+WC)u + (uᵀWu)(uᵀCu) on the sphere by
    iterating u <- top eigenvector of its linearization (the best iterate is kept).
    Exact (zero loss) when the key heads are multiples of one vector.
    """
    W = torch.diag(weight)
    loss = lambda u: float(-u @ (cov @ W + W @ cov) @ u + (u @ W @ u) * (u @ cov @ u))
    u = torch.linalg.eigh(cov)[1][:, -1]
    best, best_loss = u, loss(u)
    for _ in range(iterations):
        A = cov @ W + W @ cov - (u @ cov @ u) * W - (u @ W @ u) * cov
        u = torch.linalg.eigh(A)[1][:, -1]
        if loss(u) < best_loss - 1e-15 * abs(best_loss):
            best, best_loss = u, loss(u)
        else:
            break
    return best


def fold(head_dim: int) -> int:
    """How many source frequency pairs share one of vLLM's 32 rotary slots: f = d / 64."""
    return head_dim // ROPE_DIM


def _slot_rows(spec: AttentionSpec, slot: int) -> tuple[list[int], list[int]]:
    """Rows of slot s's components c = g·f + i (group g, pair s·f + i) in W^K (G·d, D): (first, second)."""
    d, f = spec.head_dim, fold(spec.head_dim)
    first, second = rotate_half_pairs(d)
    pairs = [slot * f + i for g in range(spec.n_kv_heads) for i in range(f)]
    offsets = [g * d for g in range(spec.n_kv_heads) for i in range(f)]
    return [o + int(first[p]) for o, p in zip(offsets, pairs)], [o + int(second[p]) for o, p in zip(offsets, pairs)]


def rotary_directions(
    w: LayerWeights, spec: AttentionSpec, moment: torch.Tensor | None
) -> tuple[torch.Tensor, float | None]:
    """(u (32, G·f) float64 unit rows, the fraction of the key energy E‖k‖² they keep; None
    without a moment, when u is only a placeholder: the export refuses to go on uncalibrated).

    Slot s of vLLM's 64 rotary dims turns at the source's θ_{s·f}; its G·f components are the
    G key heads' pairs s·f + i (i < f, f = d/64: FreqFold for d = 128). Their covariance
    C_s[c, c'] = tr(K_c M K_{c'}ᵀ) (K_c the component's 2 rows of W^K, M = E[x xᵀ]) and the
    query energy w_c of the heads that read c: `rotary_direction`. One component: u = 1, exact.
    """
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    f = fold(d)
    if G * f == 1:
        return torch.ones(ROPE_DIM // 2, 1, dtype=torch.float64), 1.0
    if moment is None:
        return torch.eye(G * f, dtype=torch.float64)[:1].expand(ROPE_DIM // 2, -1).contiguous(), None
    k = w.k.double()  # (G·d, D)
    q = w.q.double().reshape(H, d, -1)  # (H, d, D)
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    M = moment.double()  # (D, D)
    first, second = rotate_half_pairs(d)
    pair_energy = torch.einsum("hpd,de,hpe->hp", q, M, q)  # (H, d): each query row's energy
    pair_energy = pair_energy[:, first] + pair_energy[:, second]  # (H, d/2)
    per_group = torch.zeros(G, d // 2, dtype=torch.float64).index_add_(0, groups, pair_energy)  # (G, d/2)
    out = torch.empty(ROPE_DIM // 2, G * f, dtype=torch.float64)
    kept = total = 0.0
    for slot in range(ROPE_DIM // 2):
        rows_first, rows_second = _slot_rows(spec, slot)
        ks = torch.stack([k[rows_first], k[rows_second]], dim=1)  # (G·f, 2, D)
        cov = torch.einsum("cid,de,bie->cb", ks, M, ks)  # (G·f, G·f)
        weight = per_group[:, slot * f : (slot + 1) * f].reshape(G * f)  # (G·f,) component c = g·f + i
        out[slot] = rotary_direction(cov, weight / weight.sum())
        kept, total = kept + float(out[slot] @ cov @ out[slot]), total + float(cov.trace())
    return out, kept / total


def rotary_key_weights(key: torch.Tensor, spec: AttentionSpec, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key: W^K (G·d, D) (or a bias (G·d, 1)) -> (k0 (64, D): the rotary key's rows, first | second
    halves; r (G·d, D): W^K less its share of the rotary key, in W^K's row layout) —
    `rotary_mixture`/`key_remainder` on the weights."""
    G, d = spec.n_kv_heads, spec.head_dim
    hidden = key.shape[1]
    k = key.double().T.reshape(1, hidden, G, d)  # the weight's columns as (1, D, G, d) "keys"
    mixture = rotary_mixture(k, u)  # (1, D, 64)
    k0 = mixture[0].T  # (64, D)
    r = key_remainder(k, u, mixture)[0].reshape(hidden, G * d).T  # (G·d, D)
    return k0, r


def latent_content_rank(spec: AttentionSpec) -> int:
    """Dims the latent needs to hold the position-free keys and the values exactly:
    64·(G·f − 1) remainder dims (each slot's components less its rotary key) + G·d values."""
    return ROPE_DIM * (spec.n_kv_heads * fold(spec.head_dim) - 1) + spec.n_kv_heads * spec.head_dim


@dataclass(frozen=True)
class LatentFit:
    """How one layer's latent is factored (`latent_factor`): the dims it may use (at most
    `LATENT_DIMS`), the layer's calibration statistics (`convert.compress.calibrate`'s `LayerStats`,
    with the Fisher rows when calibrated for them) and sequential calibration's `SequentialStats` of
    the layer (the compressed model's inputs; None: the original's)."""

    rank: int = LATENT_DIMS
    layer_stats: object = None
    inputs: object = None


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
    need = min(latent_content_rank(spec), content.shape[1])
    if need <= rank:
        return weighted_factor(content, need), False
    row_weight = None
    if getattr(layer_stats, "key_fisher", None) is not None:
        row_weight = torch.block_diag(
            psd_sqrt(ridge(layer_stats.key_fisher.double())), psd_sqrt(ridge(layer_stats.value_fisher.double()))
        )
    if inputs is not None:
        return weighted_factor(content, rank, row_weight, moment=inputs.moment, cross=inputs.cross), True
    moment = layer_stats.moment if layer_stats is not None else None
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
) -> tuple[dict[str, torch.Tensor], bool]:
    """One layer's DeepseekV3Attention tensors (float64), by name relative to `self_attn.`, and
    whether its latent is compressed (`latent_factor`).

    u (32, G·f): the rotary directions (`rotary_directions`). stand_in (H, 2, d/2, 2): for head
    h and pair j, [h, 0, j] the (α, β) of its position-free (NoPE) terms, which stand in for the
    dropped rotation as q_hᵀ [[α, β], [-β, α]] r, and [h, 1, j] the (α', β') of the map added to
    its rotary query (`convert.targets.nope_fit`); default the terms unrotated, nothing added.
    latent: how the latent is factored (`latent_factor`); of the 512 dims those it does not use
    are zero but the norm's constant rows (`NORM_ROWS`). carrier: how the q/k/v biases ride in the
    weights (`convert.targets.vllm_bias`); required with biases."""
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    f = fold(d)
    first, second = rotate_half_pairs(d)
    hidden = w.q.shape[1]
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    if carrier is None and any(b is not None for b in (w.q_bias, w.k_bias, w.v_bias)):
        raise ValueError("q/k/v biases need a BiasCarrier (calibration statistics) to be carried")
    q = carrier.carry(w.q, w.q_bias).reshape(H, d, hidden) if carrier else w.q.double().reshape(H, d, hidden)
    key = carrier.carry(w.k, w.k_bias) if carrier else w.k
    k0, remainder = rotary_key_weights(key, spec, u)  # (64, D), (G·d, D)
    value = carrier.carry(w.v, w.v_bias) if carrier else w.v

    if stand_in is None:
        stand_in = torch.zeros(H, 2, d // 2, 2, dtype=torch.float64)
        stand_in[:, 0, :, 0] = 1.0  # unrotated
    alpha, beta, alpha_pe, beta_pe = (stand_in[:, i, :, j].double()[..., None] for i in (0, 1) for j in (0, 1))
    base = rotary_coefficients(u, groups, G)[..., None]  # (H, d/2, 1)
    # a map [[α, β], [-β, α]] on the query side of qᵀ M k: Mᵀq = (α q1 - β q2, β q1 + α q2) for pair (q1, q2)
    q1, q2 = q[:, first], q[:, second]  # (H, d/2, D)
    pe_first = ((base + alpha_pe) * q1 - beta_pe * q2).reshape(H, ROPE_DIM // 2, f, hidden).sum(2)  # (H, 32, D)
    pe_second = (beta_pe * q1 + (base + alpha_pe) * q2).reshape(H, ROPE_DIM // 2, f, hidden).sum(2)
    q_pe = torch.stack([pe_first, pe_second], dim=2).reshape(H, ROPE_DIM, hidden)  # interleaved (2s, 2s+1)
    k_pe = torch.stack([k0[: ROPE_DIM // 2], k0[ROPE_DIM // 2 :]], dim=1).reshape(ROPE_DIM, hidden)
    q_nope = torch.cat([alpha * q1 - beta * q2, beta * q1 + alpha * q2], dim=1)  # (H, d, D), W^Q's row layout

    factor, compressed = latent_factor(remainder, value, spec, latent)
    used = factor.down.shape[0]
    latent = torch.zeros(KV_LORA_RANK, hidden, dtype=torch.float64)
    latent[:used] = factor.down
    up = torch.zeros(2, G, d, KV_LORA_RANK, dtype=torch.float64)
    up[..., :used] = factor.up.reshape(2, G, d, used)  # [keys' remainder | values] per group
    kv_b = torch.cat([up[0, groups], up[1, groups]], dim=1)  # (H, 2d, 512): head h reads its group's
    latent_bias = torch.zeros(KV_LORA_RANK + ROPE_DIM, dtype=torch.float64)
    latent_bias[LATENT_DIMS:KV_LORA_RANK] = NORM_BIAS  # transformers' stand-in for the eps (`NORM_ROWS`)
    norm_weight = torch.full((KV_LORA_RANK,), math.sqrt(NORM_EPS), dtype=torch.float64)
    norm_weight[LATENT_DIMS:] = 0.0
    tensors = {
        "q_proj.weight": (q_scale * torch.cat([q_nope, q_pe], dim=1)).reshape(H * (d + ROPE_DIM), hidden),
        "kv_a_proj_with_mqa.weight": torch.cat([latent, k_pe]),  # (512 + 64, D)
        "kv_a_proj_with_mqa.bias": latent_bias,  # (512 + 64,): read by transformers only
        "kv_a_layernorm.weight": norm_weight,
        "kv_b_proj.weight": kv_b.reshape(H * 2 * d, KV_LORA_RANK),
        "o_proj.weight": s * w.o.double(),  # (D, H·d)
        "o_proj.bias": torch.zeros(hidden, dtype=torch.float64),  # attention_bias asks for it; vLLM skips it
    }
    return tensors, compressed


# ------------------------------------------------------------------ refusals


def check_vllm_exportable(config: dict, spec: AttentionSpec, source, dtype: torch.dtype, calibrated: bool) -> None:
    """Refuse, with one line each, what vLLM's MLA would serve wrongly or cannot hold."""
    if dtype not in DTYPES:
        raise ConvertError(
            f"dtype {str(dtype).removeprefix('torch.')}: the vllm target scales the residual stream by "
            f"sqrt(2^40/rms_norm_eps) (~1e8), which overflows float16; export with dtype bfloat16 or float32"
        )
    biased = biased_projections(spec, source)
    if biased and not calibrated:
        raise ConvertError(
            f"attention biases on {', '.join(p + '_proj' for p in biased)}: vLLM's DeepSeek-V3 has no attention "
            "biases, so the export carries them in the weights on calibration inputs; give --calib TEXT"
        )
    rope_type = source_rope_type(config)
    if rope_type not in ("default", "llama3"):
        raise ConvertError(
            f"config.json rope_type={rope_type!r}: vLLM rewrites any non-default RoPE of DeepSeek-V3 to "
            "DeepSeek-YaRN, which holds only default and llama3 RoPE sources; use --target transformers or --target mla"
        )
    if spec.head_dim % ROPE_DIM:
        raise ConvertError(
            f"head_dim {spec.head_dim}: the vllm target needs a multiple of {ROPE_DIM} (vLLM's 64 rotary dims hold "
            f"32 frequency pairs; d = 64·f folds f source pairs into each); use --target transformers or --target mla"
        )
    if needs_calibration(spec, config) and not calibrated:
        raise ConvertError(
            f"{spec.n_kv_heads} key/value head(s) of head_dim {spec.head_dim}: the vllm target chooses which RoPE "
            "directions to keep from calibration statistics; give --calib TEXT (a real text, not the --text one)"
        )


def needs_calibration(spec: AttentionSpec, config: dict | None = None, biased: bool = False) -> bool:
    """More than one key pair per rotary slot (G > 1 or d > 64), a source RoPE vLLM turns at
    other frequencies (llama3), or q/k/v biases (`biased`): the export is lossy and calibrated."""
    rope_type = source_rope_type(config) if config is not None else "default"
    return spec.n_kv_heads * fold(spec.head_dim) > 1 or rope_type != "default" or biased


def source_rope_type(config: dict) -> str:
    """The source config's RoPE type (`default` when it names none)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"


def export_rope_parameters(hf_src) -> dict:
    """The export's `rope_parameters`. Default RoPE as it is. Llama-3's `llama3` (θ_j ÷ factor
    below 1/low_freq_factor rotations in the original context, kept above 1/high_freq_factor,
    blended between) as the DeepSeek-YaRN vLLM computes: the same factor, context and bounds
    (beta_fast = high_freq_factor, beta_slow = low_freq_factor), blended linearly in the slot
    index instead of in frequency; mscale = mscale_all_dim = 0 and attention_factor 1, so
    neither vLLM nor transformers rescales cos/sin or the softmax."""
    rope = dict(hf_src.rope_parameters)
    theta = float(rope["rope_theta"])
    if rope.get("rope_type", "default") == "default":
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope["high_freq_factor"]),
        "beta_slow": float(rope["low_freq_factor"]),
        "mscale": 0.0,
        "mscale_all_dim": 0.0,
        "attention_factor": 1.0,
    }


def rope_frequencies(hf_src, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(θ_j the source turns pair j by, θ'_j vLLM turns pair j's rotary key by), each (d/2,)
    float64, as transformers computes them (the source's rotary embedding; DeepseekV3's on the
    export's `rope_parameters`, slot s = pair j // f)."""

    def init(config) -> torch.Tensor:
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            dim = getattr(config, "qk_rope_head_dim", None) or config.head_dim
            return rope_inv_freq(float(config.rope_parameters["rope_theta"]), dim)
        return ROPE_INIT_FUNCTIONS[rope_type](config)[0].double()

    source = init(hf_src)  # (d/2,)
    export = DeepseekV3Config(
        qk_rope_head_dim=ROPE_DIM,
        rope_parameters=export_rope_parameters(hf_src),
        max_position_embeddings=hf_src.max_position_embeddings,
    )
    slots = init(export)  # (32,)
    return source, slots.repeat_interleave(fold(head_dim))


def needs_compression(spec: AttentionSpec, hidden: int, rank: int = LATENT_DIMS) -> bool:
    """The position-free keys and the values need more than the latent's `rank` dims (7B+: G·d large)."""
    return min(latent_content_rank(spec), hidden) > rank


# ------------------------------------------------------------------ the export


def vllm_geometry(spec: AttentionSpec) -> dict:
    """Head dims of the export: nope (each head's own position-free key: its group's remainder,
    d dims), rope, v."""
    return {"nope": spec.head_dim, "rope": ROPE_DIM, "v": spec.head_dim}


def resolve_vllm_spec(state_dict: dict, config) -> tuple[dict, StateDictSource, AttentionSpec]:
    """(config dict, in-memory source, attention spec) of a model the vllm target exports."""
    return export_spec(state_dict, config, "vllm")


STAND_INS = ("fit", "nope", "drop", "expected")


def position_free_stand_in(
    mode: str, layer_stats, n_heads: int, inv_freq: torch.Tensor, span: int = 1024
) -> torch.Tensor | None:
    """`attention_tensors`' stand_in (H, 2, d/2, 2) for the position-free (NoPE) terms, or None
    for the terms unrotated (their rotation dropped: right at distance 0). mode fit: the
    calibration's fit (`layer_stats.rotation_fit`, from `rotation_fit_observer`; None without
    one); drop: (α, β) = (0, 0); expected: (E[cos θ_j Δ], 0) over Δ uniform in [0, span); nothing
    added to the rotary query but with fit. Measured on a dev text: bench/vllm_variants.py."""
    if mode == "fit":
        return getattr(layer_stats, "rotation_fit", None)
    if mode == "nope":
        return None
    if mode == "drop":
        alpha = torch.zeros_like(inv_freq)
    elif mode == "expected":
        alpha = torch.cos(inv_freq[:, None] * torch.arange(span, dtype=torch.float64)[None, :]).mean(1)
    else:
        raise ValueError(f"unknown stand-in {mode!r}; use one of {STAND_INS}")
    stand_in = torch.zeros(n_heads, 2, len(inv_freq), 2, dtype=torch.float64)
    stand_in[:, 0, :, 0] = alpha
    return stand_in


def rotation_fit_observer(source, spec: AttentionSpec, config, samples: int = SAMPLES):
    """A `convert.compress.calibrate` observer that stores each layer's fitted stand-in for the
    dropped rotations (`convert.targets.nope_fit`) in its stats' `rotation_fit` (H, 2, d/2, 2):
    the layer's rotary directions from the moment just gathered, `samples` keys per query drawn
    from the original's attention probabilities (seeded by the layer index: the same every run).
    source: the in-memory source of `resolve_vllm_spec`."""
    H, G, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    inv_freq, rotary_freq = rope_frequencies(hf_config(config), d)  # (d/2,) each: slot s turns at θ'_s
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    f = fold(d)

    def observe(layer: int, x: torch.Tensor, decoder, inputs, layer_stats) -> None:
        _, rotary, mask = inputs
        u, _ = rotary_directions(read_layer(source, spec, layer), spec, layer_stats.moment)  # (32, G·f)
        base = rotary_coefficients(u, groups, G)  # (H, d/2)
        attention = decoder.self_attn
        generator = torch.Generator().manual_seed(layer)
        gram, rhs = 0, 0
        for window in x.split(1):  # one (1, L, D) window at a time: its probabilities are (H, L, L)
            L = window.shape[1]
            q = attention.q_proj(window).view(L, H, d)  # pre-RoPE queries
            k = attention.k_proj(window).view(1, L, G, d)  # pre-RoPE keys
            mixture = rotary_mixture(k, u)  # (1, L, 64): what k_pe holds
            remainder = key_remainder(k, u, mixture)[0][:, groups]  # (L, H, d): each head's group's
            rotary_key = per_pair(mixture[0], f)  # (L, d): the rotary key each query pair meets
            probs = attention_probabilities(attention, window, rotary, None if mask is None else mask[:1])
            keys = sample_keys(probs[0].cpu(), samples, generator)  # (H, L, S)
            window_gram, window_rhs = fit_normal_equations(
                q.cpu(), remainder.cpu(), rotary_key.cpu(), keys, inv_freq, rotary_freq, base
            )
            gram, rhs = gram + window_gram, rhs + window_rhs
        layer_stats.rotation_fit = fit_rotation_stand_in(gram, rhs)

    return observe


@dataclass(frozen=True)
class ExportChoices:
    """How a vllm export is made, besides the source (`to_vllm_deepseek`, `vllm_export`).

    stats: per-layer calibration statistics (`convert.compress.calibrate`; needed when G > 1 or
    d > 64; with `rotation_fit_observer` they also carry the fitted stand-in for the dropped
    rotations; with the Fisher statistics a compressed latent is weighted in loss units).
    dtype: of every tensor written (a torch dtype or its name; default the source's query weight
    dtype). stand_in, span: `position_free_stand_in`. rank: latent dims used of vLLM's 512, at
    most `LATENT_DIMS` (the rest zero but the norm's `NORM_ROWS`): below the content's, the latent
    is compressed. sequential: a `SequentialLatents` on the source and the calibration text: a
    compressed latent is then factored for the inputs the export's own layers give it (GPTQ's order).
    """

    stats: list | None = None
    dtype: torch.dtype | str | None = None
    stand_in: str = "fit"
    span: int = 1024
    rank: int = LATENT_DIMS
    sequential: "SequentialLatents | None" = None


def to_vllm_deepseek(
    state_dict: dict[str, torch.Tensor], config, choices: ExportChoices = ExportChoices()
) -> tuple[dict, dict]:
    """Export a GQA model (Llama, Mistral) as a DeepseekV3ForCausalLM that vLLM serves with MLA.

    state_dict: the source's tensors (HF names). config: its config.json dict or a
    transformers config. choices: calibration statistics, dtype, stand-in, latent rank
    (`ExportChoices`; the default: uncalibrated, which only G = 1, d = 64 allows).

    Returns (state_dict, config_dict) with `model_type: deepseek_v3`. Exact for G = 1, d = 64;
    otherwise lossy by construction (docs/design.md, "Deployment targets"): only 64 rotary key dims. Raises
    ConvertError for what vLLM would serve wrongly (docs/design.md, "Deployment targets"). `vllm_export` gives the
    same a tensor at a time.
    """
    _, config, tensors = vllm_export(state_dict, config, choices)
    out = dict(tensors)
    return out, config


def vllm_export(state_dict, config, choices: ExportChoices = ExportChoices()):
    """`to_vllm_deepseek` a tensor at a time: (layout {name: (shape, dtype)}, config_dict, an
    iterator of (name, tensor)). Every refusal comes before it returns; config_dict's
    `convert_export` is complete once the iterator is exhausted. state_dict: any mapping of
    names to tensors (`LazyTensors` reads each from a checkpoint when asked): one decoder
    layer's tensors are in memory at a time, besides what the caller keeps of those it is given.
    """
    config, source, spec = resolve_vllm_spec(state_dict, config)
    hf_src = hf_config(config)
    dtype = as_dtype(choices.dtype) or source.dtype(spec.tensor(0, "q"))
    check_vllm_exportable(config, spec, source, dtype, choices.stats is not None)
    check_exportable(hf_src, dtype if dtype != torch.float16 else torch.float32)
    if not 0 < choices.rank <= LATENT_DIMS:
        raise ValueError(
            f"rank {choices.rank}: the latent holds 1 to {LATENT_DIMS} dims ({NORM_ROWS} of vLLM's {KV_LORA_RANK} carry "
            "the latent norm's constant for transformers)"
        )
    names = pass_through_names(state_dict, spec)
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)

    geo = vllm_geometry(spec)
    q_scale = spec.softmax_scale * math.sqrt(geo["nope"] + geo["rope"])  # DeepSeek's scale is 1/sqrt(nope + rope)
    s = math.sqrt(NORM_EPS / hf_src.rms_norm_eps)
    attention = {
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": geo["nope"],
        "v_head_dim": geo["v"],
        "rope_parameters": export_rope_parameters(hf_src),
    }
    # the fields' attention_bias carries the latent norm's constant (`NORM_ROWS`): transformers reads it, vLLM skips it
    fields = deepseek_config_fields(hf_src, spec, attention, dtype) | {"rms_norm_eps": NORM_EPS}
    result = DeepseekV3Config(**fields).to_dict()
    result["rope_theta"] = fields["rope_parameters"]["rope_theta"]  # older readers (vLLM's transformers < 5.20)

    head = "lm_head.weight" if "lm_head.weight" in state_dict and not hf_src.tie_word_embeddings else None
    names = [name for name in names if name != "lm_head.weight"]  # written on its own, tied or not
    layout = {name: (source.shape(name), dtype) for name in names}
    layout["lm_head.weight"] = (source.shape(head or "model.embed_tokens.weight"), dtype)
    H, d, hidden = spec.n_heads, spec.head_dim, config["hidden_size"]
    for layer in range(spec.n_layers):
        prefix = spec.prefix(layer)
        layout |= {
            prefix + "q_proj.weight": ((H * (d + ROPE_DIM), hidden), dtype),
            prefix + "kv_a_proj_with_mqa.weight": ((KV_LORA_RANK + ROPE_DIM, hidden), dtype),
            prefix + "kv_a_proj_with_mqa.bias": ((KV_LORA_RANK + ROPE_DIM,), dtype),
            prefix + "kv_a_layernorm.weight": ((KV_LORA_RANK,), dtype),
            prefix + "kv_b_proj.weight": ((H * 2 * d, KV_LORA_RANK), dtype),
            prefix + "o_proj.weight": ((hidden, H * d), dtype),
            prefix + "o_proj.bias": ((hidden,), dtype),
        }
    plan = _ExportPlan(state_dict, source, spec, hf_src, config, result, names, head, dtype, s, q_scale)
    return layout, result, _export_tensors(plan, choices)


@dataclass
class _ExportPlan:
    """What `vllm_export` resolved before the first tensor: its source, geometry and scales."""

    state_dict: object  # name -> tensor mapping
    source: StateDictSource
    spec: AttentionSpec
    hf_src: object  # the source's transformers config
    config: dict
    result: dict  # the export's config.json (its convert_export filled by `_export_tensors`)
    names: list  # pass-through tensors
    head: str | None  # the source's untied lm_head, or None (the embedding)
    dtype: torch.dtype
    s: float  # residual scale
    q_scale: float


def _export_tensors(plan: _ExportPlan, choices: ExportChoices):
    """`vllm_export`'s tensors, in `layout`'s order (the pass-through ones, lm_head, the layers')."""
    state_dict, source, spec, hf_src, config, result = (
        plan.state_dict,
        plan.source,
        plan.spec,
        plan.hf_src,
        plan.config,
        plan.result,
    )
    dtype, s, q_scale = plan.dtype, plan.s, plan.q_scale
    stats, sequential = choices.stats, choices.sequential
    for name in plan.names:
        tensor = state_dict[name]
        scale = s if name == "model.embed_tokens.weight" or name.endswith("mlp.down_proj.weight") else None
        yield name, _cast(tensor, dtype, scale)
    yield "lm_head.weight", _cast(state_dict[plan.head or "model.embed_tokens.weight"], dtype)
    inv_freq = rope_frequencies(hf_src, spec.head_dim)[0]
    retained, fitted, compressed, carried = [], [], [], []
    for layer in range(spec.n_layers):
        weights = read_layer(source, spec, layer)
        layer_stats = stats[layer] if stats is not None else None
        u, kept = rotary_directions(weights, spec, layer_stats.moment if layer_stats is not None else None)
        carrier, weights = _carried_biases(weights, layer_stats, carried)
        retained.append(kept)
        terms = position_free_stand_in(choices.stand_in, layer_stats, spec.n_heads, inv_freq, choices.span)
        fitted.append(terms is not None)
        prefix = spec.prefix(layer)
        inputs = sequential.stats(layer) if sequential is not None else None
        latent = LatentFit(choices.rank, layer_stats, inputs)
        tensors, squeezed = attention_tensors(weights, spec, u, q_scale, s, terms, latent, carrier)
        compressed.append(squeezed)
        if sequential is not None:
            tensors = sequential.advance(layer, tensors, result, s, refine=squeezed)
        for name, tensor in tensors.items():
            yield prefix + name, tensor.to(dtype).contiguous()

    exact = not needs_calibration(spec, config, bool(carried)) and not any(compressed)
    result["convert_export"] = {
        "target": "vllm",
        "source_model_type": config.get("model_type"),
        "residual_scale": s,
        "source_rms_norm_eps": hf_src.rms_norm_eps,
        "q_scale": q_scale,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "exact": exact,
        "frequency_fold": fold(spec.head_dim),
        "rotary_key_energy_kept": retained,
        "position_free_terms": "exact" if exact else (choices.stand_in if all(fitted) else "nope"),
        "source_rope_type": source_rope_type(config),
        "latent_content_dims": latent_content_rank(spec),
        "latent_dims_used": min(choices.rank, latent_content_rank(spec), spec.hidden_size),
        "latent_compressed": any(compressed),
        "latent_weighting": _weighting_name(stats) if any(compressed) else None,
        "latent_calibration": (
            ("sequential" if sequential is not None and sequential.refit else "original") if any(compressed) else None
        ),
        # Adam steps per compressed layer fitting its attention output (convert.compress.refine)
        "latent_refine_steps": sequential.refine_steps if sequential is not None and any(compressed) else 0,
        "kv_cache_dims_per_token_per_layer": cache_values_per_layer(),
        "gqa_cache_dims_per_token_per_layer": 2 * spec.n_kv_heads * spec.head_dim,
        # q/k/v biases carried in the weights (convert.targets.vllm_bias): per layer, the share of a bias
        # left out and each projection's relative output error from it
        "attention_biases": _bias_summary(carried),
    }


def _carried_biases(weights: LayerWeights, layer_stats, figures: list) -> tuple[BiasCarrier | None, LayerWeights]:
    """(the layer's `BiasCarrier` for its q/k/v biases, or None without; its weights with an o_proj
    bias carried into W^O on the attention outputs), the figures appended to `figures` when it has
    biases: {"left_out": share, "q"/"k"/"v"/"o": the projection's relative output error,
    "o_left_out": the o_proj carrier's share}."""
    biases = {"q": weights.q_bias, "k": weights.k_bias, "v": weights.v_bias}
    if all(b is None for b in (*biases.values(), weights.o_bias)):
        return None, weights
    entry, carrier = {}, None
    if any(b is not None for b in biases.values()):
        carrier = bias_carrier(layer_stats)
        entry["left_out"] = carrier.left_out
    for proj, bias in biases.items():
        if bias is not None:
            entry[proj] = output_error(getattr(weights, proj), bias, layer_stats, carrier)
    if weights.o_bias is not None:
        outputs = output_stats(layer_stats)
        o_carrier = bias_carrier(outputs)
        entry["o"] = output_error(weights.o, weights.o_bias, outputs, o_carrier)
        entry["o_left_out"] = o_carrier.left_out
        weights = replace(weights, o=o_carrier.carry(weights.o, weights.o_bias), o_bias=None)
    figures.append(entry)
    return carrier, weights


def _bias_summary(figures: list[dict]) -> dict | None:
    """convert_export's `attention_biases`: None without biases, else the per-layer figures."""
    if not figures:
        return None
    projections = [p for p in "qkvo" if p in figures[0]]
    summary = {
        "carried": [p + "_proj" for p in projections],
        "where": "in the projection weights, on the calibration inputs' constant (least squares)",
        "left_out_share": [f.get("left_out", 0.0) for f in figures],
        "output_error": {p + "_proj": [f[p] for f in figures] for p in projections},
    }
    if "o" in projections:  # o_proj's carrier: the attention outputs' constant
        summary["o_proj_left_out_share"] = [f["o_left_out"] for f in figures]
    return summary


def _cast(tensor: torch.Tensor, dtype: torch.dtype, scale: float | None = None, rows: int = 8192) -> torch.Tensor:
    """tensor in dtype, its own copy; × scale in float64 first, `rows` rows at a time (the
    embedding of a 128k vocabulary would be 4 GB in float64 at once)."""
    if scale is None:
        cast = tensor.to(dtype)
        return (cast.clone() if cast.data_ptr() == tensor.data_ptr() else cast).contiguous()
    out = torch.empty(tensor.shape, dtype=dtype)
    for start in range(0, tensor.shape[0], rows):
        out[start : start + rows] = (tensor[start : start + rows].double() * scale).to(dtype)
    return out


def _weighting_name(stats) -> str:
    """How a compressed latent's error was weighted (`latent_factor`)."""
    if stats is not None and getattr(stats[0], "key_fisher", None) is not None:
        return "fisher"
    return "whitened" if stats is not None else "svd"


class SequentialLatents:
    """Sequential calibration of the vllm target's compressed latent (`convert.compress.sequential`):
    the calibration text runs through the original model and, side by side, through the source
    with the export's attention in the layers converted so far, so layer ℓ's latent is factored
    for the inputs it will see and its up-projections refit to the original layer's keys and
    values (refit=False: factored on the original's inputs as without it). With `refinement`
    steps, each compressed layer's export attention is then fitted to the original layer's
    attention output (`convert.compress.refine`). One decoder layer in memory, plus both streams'
    hidden states."""

    def __init__(
        self,
        checkpoint,
        config: dict,
        token_ids: torch.Tensor,
        refit: bool = True,
        refinement: Refinement = NO_REFINEMENT,
    ):
        self.refit = refit
        self.calibration = SequentialCalibration(checkpoint, config, token_ids, refinement=refinement)

    @property
    def refine_steps(self) -> int:
        return self.calibration.refinement.steps

    def stats(self, layer: int):
        """Layer `layer`'s `SequentialStats` (loads it); None when the latent is not refit."""
        return self.calibration.stats(layer) if self.refit else None

    def advance(
        self, layer: int, tensors: dict[str, torch.Tensor], export_config: dict, s: float, refine: bool = False
    ) -> dict[str, torch.Tensor]:
        """Run layer `layer` in both streams, the export's attention (`tensors`, by name relative to
        `self_attn.`) in the compressed one, refined first when `refine` and steps are asked.
        Returns the layer's tensors as run (refined or the given ones)."""
        attention = ExportAttention(export_config, layer, tensors, s)
        refine = refine and self.refine_steps > 0
        self.calibration.advance_with(layer, attention, refine=refine)
        return attention.export_tensors(s) if refine else tensors


class ExportAttention(torch.nn.Module):
    """The export's DeepseekV3Attention standing in a source decoder layer's self_attn: its own
    rotary embedding (the export's 64 interleaved dims), the latent norm's eps as vLLM reads it,
    its output ÷ s (o_proj carries the residual scale; the source's stream is unscaled)."""

    def __init__(self, export_config: dict, layer: int, tensors: dict[str, torch.Tensor], s: float):
        super().__init__()
        config = DeepseekV3Config.from_dict({k: v for k, v in export_config.items() if k != "convert_export"})
        config._attn_implementation = "eager"
        self.attention = DeepseekV3Attention(config, layer).to(torch.float32)
        weights = {name: t.float() for name, t in tensors.items()}
        weights["o_proj.weight"] = weights["o_proj.weight"] / s
        self.attention.load_state_dict(weights)
        _match_vllm_norm(self.attention, config.rms_norm_eps)
        self.rotary = DeepseekV3RotaryEmbedding(config)
        # what vLLM never reads is not refined (`convert.compress.refine`)
        self.untrained_parameters = tuple(name.removeprefix("self_attn.") for name in VLLM_SKIPS)

    def export_tensors(self, s: float) -> dict[str, torch.Tensor]:
        """The attention's tensors as the export writes them (o_proj × s again)."""
        tensors = {name: t.detach().clone() for name, t in self.attention.state_dict().items()}
        tensors["o_proj.weight"] = tensors["o_proj.weight"] * s
        return tensors

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        L = hidden_states.shape[1]
        if position_ids is None:
            position_ids = torch.arange(L, device=hidden_states.device)[None]
        rotary = self.rotary(hidden_states, position_ids)
        mask = additive_mask(attention_mask, L, hidden_states.dtype)
        return self.attention(hidden_states, position_embeddings=rotary, attention_mask=mask)


#: Tensors of an export vLLM never reads (its attention Linears have no biases): healing leaves them.
VLLM_SKIPS = ("self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias")


def match_vllm_norms(model) -> None:
    """Make transformers' DeepseekV3 compute what vLLM does on an export of this target.

    transformers hard-codes `kv_a_layernorm`'s eps to 1e-6; vLLM uses `rms_norm_eps` (2^40 here).
    An export carries the difference itself (`NORM_ROWS`: a latent bias transformers reads and vLLM
    skips), so stock transformers needs nothing and this leaves it alone; on an export written
    before that (no `kv_a_proj_with_mqa.bias`) it sets the eps to the config's. Also marks the
    attention biases vLLM skips as not to be trained (`convert.healing`)."""
    for layer in model.model.layers:
        _match_vllm_norm(layer.self_attn, model.config.rms_norm_eps)
    model.untrained_parameters = VLLM_SKIPS


def _match_vllm_norm(attention: torch.nn.Module, eps: float) -> None:
    """A DeepseekV3Attention's latent norm as vLLM computes it: as it is with the latent bias
    (`NORM_ROWS`), else with its eps (transformers names it variance_epsilon) set to `eps`."""
    if getattr(attention.kv_a_proj_with_mqa, "bias", None) is not None:
        return
    norm = attention.kv_a_layernorm
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", eps)


# ------------------------------------------------------------------ the target's interface (convert.targets)

NAME = "vllm"
#: What other runtimes make of this output.
FOREIGN = (
    "stock transformers runs it as a DeepseekV3ForCausalLM and computes the model vLLM serves (compare or "
    "evaluate there); to train it, use convert heal, which keeps frozen the biases vLLM ignores"
)
#: How the vllm target's compressed latent is calibrated unless --calibration says: original measured
#: better at 75% and 25% of the latent's need on SmolLM2, sequential at 50% (bench/vllm_latent.py).
VLLM_CALIBRATION = "original"


def check(spec: AttentionSpec, opts) -> None:
    """What DeepSeek-V3's dense layers cannot hold (q/k norms, fused MLPs); vLLM's own limits are
    checked with the export's geometry (`check_vllm_exportable`)."""
    check_deepseek(spec, NAME)


def build(source, opts) -> Build:
    """The export's tensors, read from the source a tensor at a time as they are written, calibrated
    on --calib when there is more than one key/value head. Every refusal comes before calibration."""
    spec = resolve_spec(source, source.config, opts)  # the same checks and refusals as the mla target
    check(spec, opts)
    layout, config, tensors = export_tensors(source, LazyTensors(source), opts)
    return Build(
        layout=layout,
        copied=[],
        tensors=exporting(tensors, len(layout), opts.progress),
        config=lambda: config,
        notes=lambda: [short_note(config["convert_export"]), FOREIGN],  # complete once every tensor is written
        sizes=lambda: export_sizes(source, spec, opts, layout, config),
        metadata={"format": "pt"},
        options=opts,
    )


def model(state: dict, config: dict, opts, dtype: torch.dtype, device):
    """`to_mla(target="vllm")`: the export as transformers' DeepseekV3ForCausalLM with vLLM's
    latent-norm eps (`match_vllm_norms`), in memory."""
    source = export_source(state, config, opts, NAME)  # the same refusals as a conversion
    _, export_config, tensors = export_tensors(source, state, opts)
    export = export_model(dict(tensors), export_config, dtype, device, NAME)
    match_vllm_norms(export)
    return export


def load(path, device, dtype):
    """The export as transformers loads it, with vLLM's latent-norm eps: the model vLLM serves."""
    model = load_pretrained(path, device, dtype)
    match_vllm_norms(model)
    return model


def export_tensors(source, state_dict, opts):
    """The vllm export of `source` (a checkpoint or an in-memory source) as `vllm_export` gives it:
    (layout, config_dict, an iterator of (name, tensor)), calibrated on --calib when given.
    state_dict: the source's tensors by name (read lazily from a checkpoint)."""
    config, src_view, spec = resolve_vllm_spec(state_dict, source.config or {})
    dtype = src_view.dtype(spec.tensor(0, "q"))
    biased = biased_projections(spec, src_view)
    calibrate = needs_calibration(spec, config, bool(biased))
    check_vllm_exportable(config, spec, src_view, dtype, opts.calib is not None or not calibrate)
    lossy = calibrate or needs_compression(spec, config["hidden_size"])
    if lossy and opts.verify and (opts.text is None or opts.max_ppl_ratio is None):
        raise ConvertError(
            "--target vllm is lossy for this model (vLLM rotates 64 key dims shared by all heads at one frequency "
            "set): verification judges it by perplexity on real text, so pass --text FILE (a text unlike --calib) "
            "and --max-ppl-ratio R (e.g. 1.1), or --no-verify"
        )
    stats = sequential = None
    if opts.calib is not None:
        ids = calibration_ids(source, opts)
        bar = progress_bar("calibrating", "layer", opts.progress)
        rotation_fit = rotation_fit_observer(src_view, spec, config) if calibrate else None
        outputs = output_observer() if "o" in biased else None
        observe = observers(rotation_fit, outputs)
        stats = compress.calibrate(source, config, ids, spec.n_layers, progress=bar, observe=observe)
        if needs_compression(spec, config["hidden_size"]):  # the latent is compressed: weigh it in loss units
            fisher_bar = progress_bar("fisher statistics", "layer", opts.progress)
            fisher = compress.fisher_calibrate_streamed(source, config, ids, spec.n_layers, progress=fisher_bar)
            for layer_stats, layer_fisher in zip(stats, fisher):
                layer_stats.key_fisher, layer_stats.value_fisher = layer_fisher.key_fisher, layer_fisher.value_fisher
            refit = (opts.calibration or VLLM_CALIBRATION) == "sequential"
            # refinement of the export's latent is not yet measured on a real model: only when asked
            refinement = Refinement.sized(opts.refine_steps) if opts.refine_steps is not None else NO_REFINEMENT
            if refit or refinement.steps:
                module_source = getattr(source, "module_source", source)
                sequential = SequentialLatents(module_source, config, ids, refit=refit, refinement=refinement)
    return vllm_export(state_dict, config, ExportChoices(stats=stats, sequential=sequential))


def report(export: dict, e2e: dict | None, ckpt_dtype: torch.dtype) -> dict:
    """The report's section: the cache in vLLM against the original's, and where it is lossy."""
    size = dtype_itemsize(ckpt_dtype)
    layers = len(export["rotary_key_energy_kept"])
    return {
        "name": NAME,
        "exact": export["exact"],
        "cache_values_per_token_per_layer": export["kv_cache_dims_per_token_per_layer"],
        "gqa_cache_values_per_token_per_layer": export["gqa_cache_dims_per_token_per_layer"],
        "cache_bytes_per_token": export["kv_cache_dims_per_token_per_layer"] * size * layers,
        "gqa_cache_bytes_per_token": export["gqa_cache_dims_per_token_per_layer"] * size * layers,
        "perplexity_ratio": (e2e or {}).get("ppl_ratio"),
        "note": note(export),
    }


def short_note(info: dict) -> str:
    """What the vllm target keeps and loses, in one line that says what to do (the summary's note;
    the report has the whole paragraph, `note`)."""
    cache, gqa = info["kv_cache_dims_per_token_per_layer"], info["gqa_cache_dims_per_token_per_layer"]
    size = (
        f"{cache} cached values per token and layer, more than this model's GQA cache ({gqa}): MLA saves memory "
        "from ~7B on"
        if cache > gqa
        else f"{cache} cached values per token and layer (GQA: {gqa})"
    )
    if info["exact"]:
        return f"for vLLM: exact; {size}"
    biases = info.get("attention_biases")
    carried = f"; q/k/v biases carried in the weights ({', '.join(biases['carried'])})" if biases else ""
    return (
        f"for vLLM: LOSSY, vLLM rotates one 64-dim key shared by all {info['n_kv_heads']} key heads{carried}: check "
        f"the perplexity ratio before serving (verification.md, 'Target vllm', says what changed); {size}"
    )


def note(info: dict) -> str:
    """What the vllm target keeps and loses, in one paragraph (the report's; `short_note` the summary's)."""
    G, d = info["n_kv_heads"], info["head_dim"]
    cache, gqa = info["kv_cache_dims_per_token_per_layer"], info["gqa_cache_dims_per_token_per_layer"]
    size = "LARGER than" if cache > gqa else "smaller than"
    text = (
        f"DeepseekV3ForCausalLM for vLLM's MLA: {cache} cached values per token per layer, {size} the original GQA "
        f"cache ({gqa} = 2·{G}·{d}); the saving comes at 7B+ (Llama-3-8B: 2048 -> 576). "
    )
    if info["exact"]:
        return text + "Exact: one key/value head of head_dim 64 fits vLLM's 64 shared rotary dims."
    kept = [e for e in info["rotary_key_energy_kept"] if e is not None]
    share = f" (they carry {100 * sum(kept) / len(kept):.1f}% of the key energy)" if kept else ""
    stand_in = {
        "fit": " and replaced by fixed 2x2 maps per head and frequency, on those terms and on the rotary query, "
        "fitted on the calibration text (least squares on key samples drawn from the attention)",
        "nope": " (the terms kept unrotated)",
    }.get(info.get("position_free_terms"), f" (stand-in: {info.get('position_free_terms')})")
    f = info.get("frequency_fold", 1)
    components = f"{G} key heads' rotary pairs" if f == 1 else f"{G} key heads' {f} folded frequency pairs"
    folded = (
        f"; head_dim {d} folds {f} source frequencies into each of vLLM's 32 (the others turn at the slot's)"
        if f > 1
        else ""
    )
    latent = ""
    if info.get("latent_compressed"):
        latent = (
            f" The latent is COMPRESSED: the position-free keys and values need {info['latent_content_dims']} dims, "
            f"vLLM holds {info['latent_dims_used']} ({info['latent_weighting']}-weighted factorization)."
        )
    return text + (
        f"LOSSY: vLLM rotates only 64 key dims shared by all heads, one frequency set{folded}; of the {components} "
        f"per rotary slot the principal mixture stays rotary{share}, the other {G * f - 1} become position-free "
        f"(NoPE) dims in the latent, their rotation dropped{stand_in}.{latent}{_bias_note(info)} Stock "
        "transformers' DeepseekV3 computes the same model as vLLM (compare there)."
    )


def _left_out(biases: dict) -> float:
    """The largest share of a bias any layer's carrier leaves out (q/k/v's and o_proj's)."""
    return max(biases["left_out_share"] + biases.get("o_proj_left_out_share", []))


def _bias_note(info: dict) -> str:
    """The note's sentence on carried attention biases ('' without)."""
    biases = info.get("attention_biases")
    if not biases:
        return ""
    worst = {proj: max(errors) for proj, errors in biases["output_error"].items()}
    figures = ", ".join(f"{proj} {100 * err:.2g}%" for proj, err in worst.items())
    return (
        f" The attention biases ({', '.join(biases['carried'])}), which vLLM's DeepSeek-V3 does not have, are carried "
        f"in the weights on the calibration inputs: at most {100 * _left_out(biases):.2g}% of a bias left "
        f"out, each projection's output off by at most {figures} (mean square)."
    )
