"""A DeepSeek-V3 checkpoint in the one shape vLLM's MLA kernels serve (DESIGN §10, target `vllm`).

vLLM's MLA takes `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (576 cached values per token
per layer), one `k_pe` of 64 rotary dims shared by every head, interleaved RoPE with one
frequency set, no attention biases. Per layer, with H query heads, G key/value groups,
head dim d = 64, hidden D, nope = max((G-1)·d, d):

  q_proj              (H·(nope+64), D)  head h: [q_nope | q_pe], × the softmax-scale ratio c
  kv_a_proj_with_mqa  (512 + 64, D)     [latent: k_nope ((G-1)·d) | v (G·d) | 0 ; k_pe (64)]
  kv_a_layernorm      (512,)            2^20 (the norm is linear, see below)
  kv_b_proj           (H·(nope+d), 512) per head [k_nope: identity | v: group g(h)'s d dims]
  o_proj              (D, H·d)          W^O × s

- RoPE across groups (RoRoPE, as TransMLA): for frequency j the G key heads' pairs
  (k_g[j], k_g[j+d/2]) can be mixed by any orthogonal G×G matrix U_j (the same for both
  components): rotation acts on the pair, U_j on the group index, so they commute, and
  q_h·R k_{g(h)} = Σ_c U_j[c, g(h)] q_h·R k'_c. Component c = 0 goes to the shared
  `k_pe` (the query head's `q_pe` = U_j[0, g(h)] q_h); components c ≥ 1 become NoPE dims of
  the latent, their rotation dropped. U_j's first row minimizes the query-weighted score
  energy that loses its rotation, on the calibration text (`rotary_direction`). Exact for
  G = 1, and for key heads that are multiples of one another.
- In place of the dropped rotation R(-θ_j Δ), head h's NoPE query carries a fixed 2×2
  stand-in [[α_j, β_j], [-β_j, α_j]] per frequency, and its rotary query gains a map of the
  same form on its own pairs (the rotary key carries what of the remainder is correlated with
  it), all of a head's fitted together to its position-free score on the calibration text, by
  least squares over (query, key) pairs drawn from the original's attention probabilities
  (`convert.targets.nope_fit`, gathered in the calibration pass by `rotation_fit_observer`);
  without calibration the terms stay unrotated. SmolLM2 dev-text perplexity: ×1.05 fitted,
  ×1.36 unrotated (bench/vllm_variants.py).
- The latent norm: `rms_norm_eps` = 2^40 makes RMSNorm of the O(1) latent linear (×2^-20,
  undone by its weight 2^20); the residual stream is scaled by s = sqrt(2^40 / eps_source)
  (embeddings, o_proj, down_proj × s), so every other norm sees exactly the source's eps and
  the final norm leaves lm_head's input unchanged. transformers' DeepseekV3 hard-codes that
  norm's eps to 1e-6: `match_vllm_norms(model)` sets it to the config's before comparing.

Refused (ConvertError, before any work): attention biases (vLLM loads none), RoPE types
other than `default` (vLLM rewrites them to DeepSeek-YaRN), head_dim ≠ 64, a latent above
512, G > 1 without calibration statistics, float16 (the scaled residual overflows).
"""

import math

import torch

from convert.arch import AttentionSpec
from convert.errors import ConvertError
from convert.linalg.heads import group_of_head
from convert.source import StateDictSource, check_layer, read_layer
from convert.targets.deepseek import (
    _as_dtype,
    _check_exportable,
    _deepseek_config_fields,
    _pass_through_names,
    export_spec,
)
from convert.targets.nope_fit import (
    SAMPLES,
    attention_probabilities,
    fit_normal_equations,
    fit_rotation_stand_in,
    key_remainder,
    rope_inv_freq,
    rotary_mixture,
    sample_keys,
)
from convert.transform import LayerWeights

KV_LORA_RANK = 512
ROPE_DIM = 64
NORM_EPS = 2.0**40  # rms_norm_eps of the export: the latent norm is linear
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


def complete_basis(u: torch.Tensor) -> torch.Tensor:
    """An orthogonal (G, G) whose first row is u (G,) (the other rows: any orthonormal complement)."""
    G = u.shape[0]
    q, _ = torch.linalg.qr(torch.cat([u[:, None], torch.eye(G, dtype=u.dtype)], dim=1))  # (G, G)
    q = q[:, :G] * torch.sign(q[:, :1].T @ u)  # first column = u
    return q.T


def group_rotations(w: LayerWeights, spec: AttentionSpec, moment: torch.Tensor | None) -> torch.Tensor:
    """U (d/2, G, G) float64, orthogonal per frequency: row 0 the rotary direction.

    The key covariance of frequency j, C_j[g, g'] = tr(K_{g,j} M K_{g',j}ᵀ) (K_{g,j} the
    pair's 2 rows of W^K, M = E[x xᵀ]), and the groups' query energy
    w_g = Σ_{h∈g} tr(Q_{h,j} M Q_{h,j}ᵀ): `rotary_direction`.
    """
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    half = d // 2
    if G == 1:
        return torch.ones(half, 1, 1, dtype=torch.float64)
    first, second = rotate_half_pairs(d)
    k = w.k.double().reshape(G, d, -1)  # (G, d, D)
    q = w.q.double().reshape(H, d, -1)  # (H, d, D)
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    M = moment.double()  # (D, D)
    out = torch.empty(half, G, G, dtype=torch.float64)
    for j in range(half):
        kj = k[:, [int(first[j]), int(second[j])]]  # (G, 2, D)
        qj = q[:, [int(first[j]), int(second[j])]]  # (H, 2, D)
        cov = torch.einsum("gid,de,hie->gh", kj, M, kj)  # (G, G)
        q_energy = torch.einsum("hid,de,hie->h", qj, M, qj)  # (H,)
        weight = torch.zeros(G, dtype=torch.float64).index_add_(0, groups, q_energy)  # (G,)
        out[j] = complete_basis(rotary_direction(cov, weight / weight.sum()))
    return out


def attention_tensors(
    w: LayerWeights,
    spec: AttentionSpec,
    rotations: torch.Tensor,
    nope: int,
    q_scale: float,
    s: float,
    stand_in: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One layer's DeepseekV3Attention tensors (float64), by name relative to `self_attn.`.

    stand_in (H, 2, d/2, 2): for head h and frequency j, [h, 0, j] the (α, β) of its position-free
    (NoPE) terms, which stand in for the dropped rotation as q_hᵀ [[α, β], [-β, α]] r, and
    [h, 1, j] the (α', β') of the map added to its rotary query (`convert.targets.nope_fit`);
    default the terms unrotated, nothing added."""
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    first, second = rotate_half_pairs(d)
    hidden = w.q.shape[1]
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    k = w.k.double().reshape(G, d, hidden)  # (G, d, D)
    q = w.q.double().reshape(H, d, hidden)  # (H, d, D)
    # mixed keys per frequency: k'_c[j] = Σ_g U_j[c, g] k_g[pair j]
    k_first = torch.einsum("jcg,gjD->cjD", rotations, k[:, first])  # (G, d/2, D)
    k_second = torch.einsum("jcg,gjD->cjD", rotations, k[:, second])  # (G, d/2, D)
    coef = rotations[:, :, groups]  # (d/2, G, H): U_j[c, g(h)]
    q_first = torch.einsum("jch,hjD->chjD", coef, q[:, first])  # (G, H, d/2, D)
    q_second = torch.einsum("jch,hjD->chjD", coef, q[:, second])  # (G, H, d/2, D)

    if stand_in is None:
        stand_in = torch.zeros(H, 2, d // 2, 2, dtype=torch.float64)
        stand_in[:, 0, :, 0] = 1.0  # unrotated
    alpha, beta = (stand_in[:, 0, :, i].double()[None, :, :, None] for i in (0, 1))  # (1, H, d/2, 1)
    alpha_pe, beta_pe = (stand_in[:, 1, :, i].double()[:, :, None] for i in (0, 1))  # (H, d/2, 1)
    # a map [[α, β], [-β, α]] on the query side of qᵀ M k: Mᵀq = (α q1 - β q2, β q1 + α q2) for pair (q1, q2)
    q1, q2 = q[:, first], q[:, second]  # (H, d/2, D)
    q_pe_first = q_first[0] + alpha_pe * q1 - beta_pe * q2  # (H, d/2, D)
    q_pe_second = q_second[0] + beta_pe * q1 + alpha_pe * q2
    k_pe = torch.stack([k_first[0], k_second[0]], dim=1).reshape(ROPE_DIM, hidden)  # interleaved (2j, 2j+1)
    q_pe = torch.stack([q_pe_first, q_pe_second], dim=2).reshape(H, ROPE_DIM, hidden)  # (H, 64, D)
    used = (G - 1) * d  # NoPE dims that carry something
    k_nope = torch.cat([k_first[1:], k_second[1:]], dim=1).reshape(used, hidden)  # (used, D)
    q_nope = torch.zeros(H, nope, hidden, dtype=torch.float64)
    first_nope = alpha * q_first[1:] - beta * q_second[1:]  # (G-1, H, d/2, D)
    second_nope = beta * q_first[1:] + alpha * q_second[1:]  # (G-1, H, d/2, D)
    q_nope[:, :used] = torch.cat([first_nope, second_nope], dim=2).permute(1, 0, 2, 3).reshape(H, used, hidden)

    latent = torch.zeros(KV_LORA_RANK, hidden, dtype=torch.float64)
    latent[:used] = k_nope
    latent[used : used + G * d] = w.v.double()  # (G·d, D)
    kv_b = torch.zeros(H, nope + d, KV_LORA_RANK, dtype=torch.float64)
    kv_b[:, torch.arange(used), torch.arange(used)] = 1.0
    v_cols = used + groups[:, None] * d + torch.arange(d)[None, :]  # (H, d)
    kv_b[torch.arange(H)[:, None], nope + torch.arange(d)[None, :], v_cols] = 1.0
    return {
        "q_proj.weight": (q_scale * torch.cat([q_nope, q_pe], dim=1)).reshape(H * (nope + ROPE_DIM), hidden),
        "kv_a_proj_with_mqa.weight": torch.cat([latent, k_pe]),  # (512 + 64, D)
        "kv_a_layernorm.weight": torch.full((KV_LORA_RANK,), math.sqrt(NORM_EPS), dtype=torch.float64),
        "kv_b_proj.weight": kv_b.reshape(H * (nope + d), KV_LORA_RANK),
        "o_proj.weight": s * w.o.double(),  # (D, H·d)
    }


# ------------------------------------------------------------------ refusals


def check_vllm_exportable(config: dict, spec: AttentionSpec, source, dtype: torch.dtype, calibrated: bool) -> None:
    """Refuse, with one line each, what vLLM's MLA would serve wrongly or cannot hold."""
    if dtype not in DTYPES:
        raise ConvertError(
            f"dtype {str(dtype).removeprefix('torch.')}: the vllm target scales the residual stream by "
            f"sqrt(2^40/rms_norm_eps) (~1e8), which overflows float16; export with dtype bfloat16 or float32"
        )
    biased = sorted(
        {proj for layer in range(spec.n_layers) for proj in "qkvo" if spec.tensor(layer, proj, "bias") in source}
    )
    if biased:
        raise ConvertError(
            f"attention biases on {', '.join(p + '_proj' for p in biased)}: vLLM's DeepSeek-V3 loads no attention "
            "biases and would drop them silently; use --target transformers (exact, stock transformers) or mla"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        raise ConvertError(
            f"config.json rope_type={rope_type!r}: vLLM rewrites any non-default RoPE of DeepSeek-V3 to "
            "DeepSeek-YaRN and would rotate differently; use --target transformers or mla"
        )
    if spec.head_dim != ROPE_DIM:
        raise ConvertError(
            f"head_dim {spec.head_dim}: the vllm target needs head_dim {ROPE_DIM} (vLLM's 64 rotary dims hold one "
            "frequency set of 32 pairs; folding d = 128 frequencies is not implemented); use --target transformers"
        )
    latent = (spec.n_kv_heads - 1) * spec.head_dim + spec.n_kv_heads * spec.head_dim
    if latent > KV_LORA_RANK:
        raise ConvertError(
            f"{spec.n_kv_heads} key/value heads need a latent of {latent} dims (NoPE keys + values), above vLLM's "
            f"kv_lora_rank {KV_LORA_RANK}; compressing into it is not implemented: use --target mla with "
            "--kv-cache-ratio"
        )
    if spec.n_kv_heads > 1 and not calibrated:
        raise ConvertError(
            f"{spec.n_kv_heads} key/value heads: the vllm target chooses which RoPE directions to keep from "
            "calibration statistics; give --calib TEXT (a real text, not the --text one)"
        )


# ------------------------------------------------------------------ the export


def vllm_geometry(spec: AttentionSpec) -> dict:
    """Head dims of the export: nope, rope, v."""
    return {"nope": max((spec.n_kv_heads - 1) * spec.head_dim, spec.head_dim), "rope": ROPE_DIM, "v": spec.head_dim}


def resolve_vllm_spec(state_dict: dict, config) -> tuple[dict, StateDictSource, AttentionSpec]:
    """(config dict, in-memory source, attention spec) of a model the vllm target exports."""
    return export_spec(state_dict, config, "vllm")


STAND_INS = ("fit", "nope", "drop", "expected")


def position_free_stand_in(
    mode: str, layer_stats, n_heads: int, head_dim: int, theta: float, span: int = 1024
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
    inv_freq = rope_inv_freq(theta, head_dim)  # (d/2,)
    if mode == "drop":
        alpha = torch.zeros_like(inv_freq)
    elif mode == "expected":
        alpha = torch.cos(inv_freq[:, None] * torch.arange(span, dtype=torch.float64)[None, :]).mean(1)
    else:
        raise ValueError(f"unknown stand-in {mode!r}; use one of {STAND_INS}")
    stand_in = torch.zeros(n_heads, 2, head_dim // 2, 2, dtype=torch.float64)
    stand_in[:, 0, :, 0] = alpha
    return stand_in


def rotation_fit_observer(source, spec: AttentionSpec, config, samples: int = SAMPLES):
    """A `convert.compress.calibrate` observer that stores each layer's fitted stand-in for the
    dropped rotations (`convert.targets.nope_fit`) in its stats' `rotation_fit` (H, 2, d/2, 2):
    the layer's rotary directions from the moment just gathered, `samples` keys per query drawn
    from the original's attention probabilities (seeded by the layer index: the same every run).
    source: the in-memory source of `resolve_vllm_spec`."""
    from convert.hf import hf_config

    theta = float(hf_config(config).rope_parameters["rope_theta"])
    H, G, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    inv_freq = rope_inv_freq(theta, d)  # (d/2,)
    groups = group_of_head(H, G, spec.head_map)  # (H,)

    def observe(layer: int, x: torch.Tensor, decoder, inputs, layer_stats) -> None:
        _, rotary, mask = inputs
        rotations = group_rotations(read_layer(source, spec, layer), spec, layer_stats.moment)  # (d/2, G, G)
        attention = decoder.self_attn
        generator = torch.Generator().manual_seed(layer)
        gram, rhs = 0, 0
        for window in x.split(1):  # one (1, L, D) window at a time: its probabilities are (H, L, L)
            L = window.shape[1]
            q = attention.q_proj(window).view(L, H, d)  # pre-RoPE queries
            k = attention.k_proj(window).view(1, L, G, d)  # pre-RoPE keys
            remainder = key_remainder(k, rotations[:, 0, :])[0][:, groups]  # (L, H, d): each head's group's
            mixture = rotary_mixture(k, rotations[:, 0, :])[0]  # (L, d): what k_pe holds
            probs = attention_probabilities(attention, window, rotary, None if mask is None else mask[:1])
            keys = sample_keys(probs[0].cpu(), samples, generator)  # (H, L, S)
            window_gram, window_rhs = fit_normal_equations(q.cpu(), remainder.cpu(), mixture.cpu(), keys, inv_freq)
            gram, rhs = gram + window_gram, rhs + window_rhs
        layer_stats.rotation_fit = fit_rotation_stand_in(gram, rhs)

    return observe


def to_vllm_deepseek(
    state_dict: dict[str, torch.Tensor], config, stats=None, dtype=None, stand_in: str = "fit", span: int = 1024
) -> tuple[dict, dict]:
    """Export a GQA model (Llama, Mistral) as a DeepseekV3ForCausalLM that vLLM serves with MLA.

    state_dict: the source's tensors (HF names). config: its config.json dict or a
    transformers config. stats: per-layer calibration statistics
    (`convert.compress.calibrate`; needed when G > 1; with `rotation_fit_observer` they also
    carry the fitted stand-in for the dropped rotations). dtype: of every tensor written
    (default the source's query weight dtype). stand_in, span: `position_free_stand_in`.

    Returns (state_dict, config_dict) with `model_type: deepseek_v3`. Exact for G = 1;
    for G > 1 lossy by construction (module docstring): only 64 rotary key dims. Raises
    ConvertError for what vLLM would serve wrongly (module docstring).
    """
    from transformers import DeepseekV3Config

    from convert.hf import hf_config

    config, source, spec = resolve_vllm_spec(state_dict, config)
    hf_src = hf_config(config)
    dtype = _as_dtype(dtype) or source.dtype(spec.tensor(0, "q"))
    check_vllm_exportable(config, spec, source, dtype, stats is not None)
    _check_exportable(hf_src, dtype if dtype != torch.float16 else torch.float32)
    names = _pass_through_names(state_dict, spec)
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)

    geo = vllm_geometry(spec)
    q_scale = spec.softmax_scale * math.sqrt(geo["nope"] + geo["rope"])  # DeepSeek's scale is 1/sqrt(nope + rope)
    s = math.sqrt(NORM_EPS / hf_src.rms_norm_eps)
    fields = _deepseek_config_fields(hf_src, spec, _Geo(spec, geo), {}, dtype)
    fields |= {
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": geo["nope"],
        "v_head_dim": geo["v"],
        "q_lora_rank": None,
        "attention_bias": False,
        "rms_norm_eps": NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(hf_src.rope_parameters["rope_theta"])},
        "rope_interleave": True,
    }
    result = DeepseekV3Config(**fields).to_dict()
    result["rope_theta"] = fields["rope_parameters"]["rope_theta"]  # older readers (vLLM's transformers < 5.20)

    out: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = state_dict[name]
        if name == "model.embed_tokens.weight" or name.endswith("mlp.down_proj.weight"):
            tensor = tensor.double() * s
        out[name] = tensor.to(dtype).contiguous()
    out["lm_head.weight"] = (
        (
            state_dict["lm_head.weight"]
            if "lm_head.weight" in state_dict and not hf_src.tie_word_embeddings
            else state_dict["model.embed_tokens.weight"]
        )
        .to(dtype)
        .clone()
    )
    theta = float(hf_src.rope_parameters["rope_theta"])
    retained, fitted = [], []
    for layer in range(spec.n_layers):
        weights = read_layer(source, spec, layer)
        layer_stats = stats[layer] if stats is not None else None
        moment = layer_stats.moment if layer_stats is not None else None
        rotations = group_rotations(weights, spec, moment)
        retained.append(rotary_energy_kept(weights, spec, rotations, moment))
        terms = position_free_stand_in(stand_in, layer_stats, spec.n_heads, spec.head_dim, theta, span)
        fitted.append(terms is not None)
        prefix = spec.prefix(layer)
        for name, tensor in attention_tensors(weights, spec, rotations, geo["nope"], q_scale, s, terms).items():
            out[prefix + name] = tensor.to(dtype).contiguous()

    result["convert_export"] = {
        "target": "vllm",
        "source_model_type": config.get("model_type"),
        "residual_scale": s,
        "source_rms_norm_eps": hf_src.rms_norm_eps,
        "q_scale": q_scale,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "exact": spec.n_kv_heads == 1,
        "rotary_key_energy_kept": retained,
        "position_free_terms": "exact" if spec.n_kv_heads == 1 else (stand_in if all(fitted) else "nope"),
        "kv_cache_dims_per_token_per_layer": cache_values_per_layer(),
        "gqa_cache_dims_per_token_per_layer": 2 * spec.n_kv_heads * spec.head_dim,
    }
    return out, result


class _Geo:
    """What `_deepseek_config_fields` reads of a geometry."""

    def __init__(self, spec: AttentionSpec, geo: dict):
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = spec.n_heads, None, KV_LORA_RANK
        self.rope_dim, self.head_dim = ROPE_DIM, geo["v"]


def rotary_energy_kept(w: LayerWeights, spec: AttentionSpec, rotations: torch.Tensor, moment) -> float | None:
    """Fraction of the query-weighted key energy in the rotary component (1.0 for G = 1)."""
    if spec.n_kv_heads == 1:
        return 1.0
    if moment is None:
        return None
    G, d = spec.n_kv_heads, spec.head_dim
    first, second = rotate_half_pairs(d)
    k = w.k.double().reshape(G, d, -1)
    M = moment.double()
    kept = total = 0.0
    for j in range(d // 2):
        kj = k[:, [int(first[j]), int(second[j])]]  # (G, 2, D)
        mixed = torch.einsum("cg,gid->cid", rotations[j], kj)  # (G, 2, D)
        energy = torch.einsum("cid,de,cie->c", mixed, M, mixed)  # (G,)
        kept, total = kept + float(energy[0]), total + float(energy.sum())
    return kept / total


def match_vllm_norms(model) -> None:
    """Give transformers' DeepseekV3 the latent-norm eps vLLM uses (the config's rms_norm_eps).

    transformers hard-codes `kv_a_layernorm`'s eps to 1e-6; vLLM uses `rms_norm_eps`, which
    the vllm target sets to 2^40. Call this on a loaded DeepseekV3ForCausalLM before
    comparing it with vLLM or the original.
    """
    eps = model.config.rms_norm_eps
    for layer in model.model.layers:
        norm = layer.self_attn.kv_a_layernorm
        if hasattr(norm, "variance_epsilon"):
            norm.variance_epsilon = eps
        else:
            norm.eps = eps
