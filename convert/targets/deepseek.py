"""An exact `DeepseekV3ForCausalLM` checkpoint for stock transformers (target `transformers`).

Built from the SOURCE GQA weights, not from the native MLA output; what both DeepSeek-V3 targets share is here too.
The construction tensor by tensor, its precision and size: docs/design.md, "Deployment targets".
"""

import math
import re
from dataclasses import dataclass

import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

from convert.arch import AttentionSpec, resolve_attention
from convert.errors import ConvertError
from convert.hf import build_causal_lm, hf_classes, hf_config, load_strict
from convert.io.reader import dtype_itemsize
from convert.layouts import attention_view
from convert.linalg.heads import group_of_head
from convert.options import dtype_name
from convert.plan import make_plan, resolve_spec
from convert.progress import progress
from convert.source import StateDictSource, check_layer, read_layer
from convert.transform import LayerWeights

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
# k of the latent-norm constant M = √n·2^k, by checkpoint dtype (docs/design.md, "Deployment targets").
NORM_EXPONENT = {torch.float32: 40, torch.float64: 40, torch.bfloat16: 20}
# Source RoPE types whose inverse frequencies are fixed at load time (longrope: two fixed sets).
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Non-attention tensors a dense DeepseekV3ForCausalLM has under the same names.
_PASS_THROUGH = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
)
# Non-persistent buffers some old checkpoints still carry: recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


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


@dataclass(frozen=True)
class SourceRope:
    """The source's RoPE as transformers computes it: float32 inverse frequencies per pair
    (d/2,), the long-context set (longrope; else the same), the cos/sin multiplier, and
    the length above which the long set applies."""

    rope_type: str
    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor
    attention_factor: float
    original_max_position_embeddings: int


# ------------------------------------------------------------------ small pieces of the math


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


def longrope_factors(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair the float32 f with float32(1/f) == inv_freq, as longrope computes it at rope_theta 1.

    inv_freq: (P,) float32. Returns (factors (P,) float32, error in units of the
    target's last place (P,)): 0 wherever float32 division reaches the target, which
    it does for every inverse frequency transformers computes as 1/base^x; where it
    cannot (1/f is not onto the floats) the nearest is taken, 1 ulp off.
    """
    target = inv_freq.to(torch.float32)
    start = (1.0 / target.double()).to(torch.float32)  # (P,)
    candidates, up, down = [start], start, start
    for _ in range(4):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        candidates += [up, down]
    cand = torch.stack(candidates, dim=1)  # (P, 9)
    miss = ((1.0 / cand).double() - target.double()[:, None]).abs()  # float32 division, as transformers
    best = miss.argmin(dim=1)
    factors = cand.gather(1, best[:, None])[:, 0]
    ulp = (torch.nextafter(target, target + 1) - target).double()
    return factors, miss.gather(1, best[:, None])[:, 0] / ulp


# ------------------------------------------------------------------ the source


def source_rope(hf_config, arch: str) -> SourceRope:
    """Inverse frequencies of the source family's own rotary class (transformers' RoPE init)."""
    rope_type = hf_config.rope_parameters.get("rope_type", "default")
    if rope_type not in EXACT_ROPE_TYPES:
        why = (
            "its frequencies change with the sequence length at run time, which DeepSeek-V3's RoPE cannot follow"
            if "dynamic" in rope_type
            else "no exact DeepSeek-V3 equivalent is known"
        )
        raise ConvertError(
            f"config.json rope_type={rope_type!r}: {why}; export with the native mla target instead "
            f"(supported RoPE types here: {', '.join(EXACT_ROPE_TYPES)})"
        )
    rotary = hf_classes(arch)[2](hf_config)
    inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()  # (d/2,)
    original_max = hf_config.max_position_embeddings
    long_inv_freq = inv_freq
    if rope_type == "longrope":
        original_max = hf_config.rope_parameters["original_max_position_embeddings"]
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=original_max + 1)
        long_inv_freq = long_inv_freq.to(torch.float32)
    return SourceRope(rope_type, inv_freq, long_inv_freq, float(rotary.attention_scaling), int(original_max))


def _sliding_window_layers(hf_config) -> list[int]:
    """Layers whose mask has a window shorter than the context (the window could matter)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= hf_config.max_position_embeddings:
        return []
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return list(range(hf_config.num_hidden_layers))
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def check_exportable(hf_config, dtype: torch.dtype) -> None:
    """Refuse, naming the field, what DeepseekV3ForCausalLM cannot hold exactly."""
    sliding = _sliding_window_layers(hf_config)
    if sliding:
        raise ConvertError(
            f"config.json sliding_window={hf_config.sliding_window} (in {len(sliding)} of "
            f"{hf_config.num_hidden_layers} layers) is shorter than max_position_embeddings="
            f"{hf_config.max_position_embeddings}: DeepseekV3 has no sliding window, so sequences longer than "
            f"{hf_config.sliding_window} tokens would attend differently; export with the native mla target"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise ConvertError("config.json mlp_bias=true: DeepseekV3's MLP has no biases; this model cannot be exported")
    if dtype not in NORM_EXPONENT:
        raise ConvertError(
            f"dtype {str(dtype).removeprefix('torch.')} cannot hold the latent-norm constant √n·2^k exactly "
            "(float16's range is too small); export with dtype float32, bfloat16 or float64"
        )


def pass_through_names(state_dict: dict, spec: AttentionSpec) -> list[str]:
    """Non-attention tensors, each checked to have a place in DeepseekV3ForCausalLM."""
    attention = {
        spec.tensor(layer, proj, kind)
        for layer in range(spec.n_layers)
        for proj in "qkvo"
        for kind in ("weight", "bias")
    }
    names = []
    for name in state_dict:
        if name in attention or _IGNORED.fullmatch(name):
            continue
        if not _PASS_THROUGH.fullmatch(name):
            raise ConvertError(
                f"tensor {name!r} has no place in a dense DeepseekV3ForCausalLM (biases and extra modules outside "
                "attention are not supported); this model cannot be exported to the transformers target"
            )
        names.append(name)
    return names


# ------------------------------------------------------------------ one layer


def _neutralized_latent(weight: torch.Tensor, bias: torch.Tensor | None, width: int, exponent: int):
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
        q_w, q_b, q_norm = _neutralized_latent(w.q, w.q_bias, geo.q_lora_rank, geo.norm_exponent)
        out["q_a_proj.weight"], out["q_a_proj.bias"], out["q_a_layernorm.weight"] = q_w, q_b, q_norm
        q_b_proj = torch.zeros(q_rows, geo.q_lora_rank, dtype=torch.float64)  # (H·R, m): latent dim = source row
        q_b_proj[target, source] = geo.q_scale
        out["q_b_proj.weight"] = q_b_proj
    lat_w, lat_b, lat_norm = _neutralized_latent(w.v, w.v_bias, geo.kv_lora_rank, geo.norm_exponent)
    k_pe_w = w.k.double()[keys]  # (R, D)
    k_pe_b = w.k_bias.double()[keys] if w.k_bias is not None else torch.zeros(geo.rope_dim, dtype=torch.float64)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([lat_w, k_pe_w])  # (n + R, D)
    out["kv_a_proj_with_mqa.bias"] = torch.cat([lat_b, k_pe_b])  # (n + R,)
    out["kv_a_layernorm.weight"] = lat_norm  # (n,)
    out["kv_b_proj.weight"] = value_expansion(geo, head_map)  # (H·d, n)
    out["o_proj.weight"] = w.o.double()  # (D, H·d)
    out["o_proj.bias"] = w.o_bias.double() if w.o_bias is not None else torch.zeros(hidden, dtype=torch.float64)
    return out


# ------------------------------------------------------------------ the config


def deepseek_rope_parameters(rope: SourceRope, n_kv_heads: int) -> tuple[dict, float]:
    """`rope_parameters` giving DeepSeek pair p = g·d/2 + j the source's frequency j.

    Returns (parameters, worst error of an inverse frequency in ulps: 0 when exact).
    """
    short, short_err = longrope_factors(rope.inv_freq)
    long, long_err = longrope_factors(rope.long_inv_freq)
    params = {
        "rope_type": "longrope",
        "rope_theta": 1.0,
        "short_factor": [float(f) for f in short.repeat(n_kv_heads)],
        "long_factor": [float(f) for f in long.repeat(n_kv_heads)],
        "original_max_position_embeddings": rope.original_max_position_embeddings,
        "attention_factor": rope.attention_factor,
        # unused when attention_factor is given (transformers' longrope); set so it does not warn
        "factor": 1.0,
    }
    return params, float(max(short_err.max(), long_err.max()))


def deepseek_config_fields(hf_src, spec: AttentionSpec, attention: dict, dtype) -> dict:
    """The config fields of a dense DeepseekV3ForCausalLM holding the source, every head reading the
    latent; `attention`: the target's own attention fields (q_lora_rank, kv_lora_rank,
    qk_rope_head_dim, qk_nope_head_dim, v_head_dim, rope_parameters), merged in."""
    layers = spec.n_layers
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": hf_src.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": hf_src.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_heads,  # the latent expands to every head
        **attention,
        "attention_bias": True,  # carries the latent-norm constant (transformers target: the source's biases too)
        "rope_interleave": True,
        # dense MLP everywhere; the MoE fields are unused but must be ints
        "first_k_dense_replace": layers,
        "moe_intermediate_size": hf_src.intermediate_size,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "num_mtp_layers": 0,
        "hidden_act": hf_src.hidden_act,
        "max_position_embeddings": hf_src.max_position_embeddings,
        "rms_norm_eps": hf_src.rms_norm_eps,
        "initializer_range": hf_src.initializer_range,
        "attention_dropout": float(getattr(hf_src, "attention_dropout", 0.0) or 0.0),
        "use_cache": bool(getattr(hf_src, "use_cache", True)),
        "pad_token_id": hf_src.pad_token_id,
        "bos_token_id": hf_src.bos_token_id,
        "eos_token_id": hf_src.eos_token_id,
        "tie_word_embeddings": False,  # lm_head is written out
        "dtype": dtype_name(dtype),
    }


def _check_installed_rope(config, rope: SourceRope, n_kv_heads: int) -> None:
    """The installed DeepseekV3 rotary gives the source's frequencies: transformers is the truth."""
    rotary = DeepseekV3RotaryEmbedding(config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=rope.original_max_position_embeddings + 1)
    for got, want, which in ((rotary.inv_freq, rope.inv_freq, "short"), (long, rope.long_inv_freq, "long")):
        want = want.repeat(n_kv_heads)
        if (
            got.shape != want.shape
            or (got.double() - want.double()).abs().max() > 2 * want.double().abs().max() * 2**-24
        ):
            raise ConvertError(
                f"the installed transformers' DeepseekV3 RoPE does not reproduce the source's {which} frequencies "
                "with longrope factors; this transformers version is not supported by the transformers target"
            )
    if rotary.attention_scaling != rope.attention_factor:
        raise ConvertError("the installed transformers' longrope ignores attention_factor; unsupported version")


# ------------------------------------------------------------------ the export


def as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype_name(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ConvertError(f"dtype {dtype!r} is not a torch dtype; use float32, bfloat16 or float64")
    return found


def export_spec(state_dict: dict, config, target: str, opts=None) -> tuple[dict, StateDictSource, AttentionSpec]:
    """(config dict, in-memory source, attention spec) of a model a DeepSeek-V3 target exports;
    refuses the families whose attention DeepSeek-V3 cannot hold (`SUPPORTED_ARCHS` only). With a
    conversion's `opts`, the spec takes its geometry flags and first meets its refusals and `check_deepseek`'s."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    source = StateDictSource(state_dict, config)
    if opts is not None:
        spec = resolve_spec(attention_view(source, config), config, opts)  # a fused qkv_proj seen split
        check_deepseek(spec, target)
    else:
        spec = resolve_attention(config, source.keys(), source.shape)
    if spec.arch.name not in SUPPORTED_ARCHS:
        raise ConvertError(
            f"--target {target}: exporting a {spec.arch.name} model to DeepSeek-V3 is not implemented (it has "
            "what DeepSeek-V3's dense layers lack: q/k norms, soft-capping, a mixture-of-experts MLP, ...); the "
            f"{target} target supports "
            f"{', '.join(SUPPORTED_ARCHS)}: use --target mla for {spec.arch.name}"
        )
    return config, source, spec


def _geometry(spec: AttentionSpec, source, rope_params: dict, dtype: torch.dtype) -> DeepseekGeometry:
    """The exact export's geometry: the latent and (with a query bias) the query latent as square
    widths, the query scale against DeepseekV3Attention's own, the latent norm's exponent."""
    rope_dim = spec.n_kv_heads * spec.head_dim
    deepseek_scale = yarn_apply_mscale(rope_params, rope_dim**-0.5)  # DeepseekV3Attention.scaling
    q_bias = any(spec.tensor(layer, "q", "bias") in source for layer in range(spec.n_layers))
    return DeepseekGeometry(
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        kv_lora_rank=square_width(rope_dim + 1, dtype),
        q_lora_rank=square_width(spec.n_heads * spec.head_dim + 1, dtype) if q_bias else None,
        q_scale=spec.softmax_scale / deepseek_scale,
        norm_exponent=NORM_EXPONENT[dtype],
    )


def to_deepseek_v3(state_dict: dict[str, torch.Tensor], config, dtype=None) -> tuple[dict, dict]:
    """Export a GQA model (Llama, Mistral, Qwen2) as an exact DeepseekV3ForCausalLM, in memory.

    state_dict: the source's tensors (HF names). config: its config.json dict or a
    transformers config. dtype: of the attention tensors written (and of every tensor:
    the others are cast when it differs); default the source's query weight dtype.

    Returns (state_dict, config_dict): the DeepseekV3ForCausalLM tensors (non-attention
    ones shared with the input when no cast is needed) and a complete config.json dict
    (`model_type: deepseek_v3`) that stock transformers loads without custom code; its
    `convert_export` entry records the construction. Raises ConvertError for what
    DeepSeek-V3 cannot hold exactly (docs/design.md, "Deployment targets").
    """
    config, source, spec = export_spec(state_dict, config, "transformers")
    hf_src = hf_config(config)  # transformers' own reading of config.json (defaults, legacy rope_scaling)
    dtype = as_dtype(dtype) or source.dtype(spec.tensor(0, "q"))
    check_exportable(hf_src, dtype)
    names = pass_through_names(state_dict, spec)
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)

    rope = source_rope(hf_src, spec.arch.name)
    rope_params, rope_ulps = deepseek_rope_parameters(rope, spec.n_kv_heads)
    rope_dim = spec.n_kv_heads * spec.head_dim
    geo = _geometry(spec, source, rope_params, dtype)
    attention = {
        "q_lora_rank": geo.q_lora_rank,
        "kv_lora_rank": geo.kv_lora_rank,
        "qk_rope_head_dim": geo.rope_dim,
        "qk_nope_head_dim": 0,
        "v_head_dim": geo.head_dim,
        "rope_parameters": rope_params,
    }
    fields = deepseek_config_fields(hf_src, spec, attention, dtype)
    ds_config = DeepseekV3Config(**fields)
    _check_installed_rope(ds_config, rope, spec.n_kv_heads)

    out: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = state_dict[name]
        out[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    if "lm_head.weight" not in out or hf_src.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    for layer in range(spec.n_layers):
        prefix = spec.prefix(layer)
        for name, tensor in attention_tensors(read_layer(source, spec, layer), geo, spec.head_map).items():
            out[prefix + name] = tensor.to(dtype).contiguous()

    result = ds_config.to_dict()
    result["convert_export"] = {
        "source_model_type": config.get("model_type"),
        "source_rope_type": rope.rope_type,
        "q_scale": geo.q_scale,
        "latent_norm_constant": norm_constant(geo.kv_lora_rank, geo.norm_exponent),
        "rope_inv_freq_max_ulp_error": rope_ulps,
        "kv_cache_dims_per_token_per_layer": geo.kv_lora_rank + rope_dim,
    }
    return out, result


# ------------------------------------------------------------------ shared by the DeepSeek-V3 targets


def check_deepseek(spec: AttentionSpec, target: str) -> None:
    """Refuse what a DeepSeek-V3 target cannot write for this source: q/k norms, fused MLPs."""
    if spec.qk_norm is not None:
        raise ConvertError(
            f"--target {target}: DeepSeek-V3 has no q/k norm, so a {spec.arch.name} model (q/k norm) cannot be "
            "written for it exactly; use --target mla (the default), which runs the norms on the latent"
        )
    if spec.arch.fused_qkv is not None:
        raise ConvertError(
            f"--target {target} writes DeepSeek-V3's MLP (gate_proj, up_proj), and {spec.arch.name}'s fused "
            "gate_up_proj is not split for it; use --target mla (the default), which keeps the MLP as it is"
        )


def export_source(state: dict, config: dict, opts, target: str):
    """`to_mla`'s in-memory source for a DeepSeek-V3 target, after the same refusals as a conversion."""
    source = attention_view(StateDictSource(state, config), config)
    check_deepseek(resolve_spec(source, config, opts), target)
    return source


def export_model(tensors: dict, config: dict, dtype: torch.dtype, device, target: str):
    """An export's tensors and config as transformers' DeepseekV3ForCausalLM, in memory, in eval mode."""
    model = build_causal_lm(config, dtype, device=device)
    load_strict(model, tensors, f"the --target {target} export")
    return model.eval()


def exporting(tensors, total: int, enabled: bool):
    """An export's (name, tensor) stream, contiguous, with its progress bar or log lines."""
    for name, tensor in progress(tensors, "exporting", "tensor", enabled, total=total):
        yield name, tensor.contiguous()


def export_sizes(source, spec: AttentionSpec, opts, layout: dict, config: dict) -> dict:
    """Attention parameters and the KV cache per token (what a DeepSeek-V3 MLA runtime
    caches: latent + rotary key), before and after, in the checkpoint's dtype."""
    source_plan = make_plan(source, spec, opts)  # headers only
    after_params = sum(math.prod(shape) for name, (shape, _) in layout.items() if ".self_attn." in name)
    after_dims = config["num_hidden_layers"] * config["convert_export"]["kv_cache_dims_per_token_per_layer"]
    size = dtype_itemsize(source_plan.dtype)
    return source_plan.sizes() | {
        "attention_params_after": after_params,
        "attention_bytes_after": after_params * size,
        "kv_cache_dims_per_token_after": after_dims,
        "kv_cache_bytes_per_token_after": after_dims * size,
    }
