"""The exact `DeepseekV3ForCausalLM` export (target `transformers`) and what both DeepSeek-V3 targets
share: which sources export, the config fields, the tensors passed through, the model, the sizes.
Built from the SOURCE GQA weights, not from the native MLA output."""

import math
import re
from typing import TYPE_CHECKING

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from convert.arch import AttentionSpec, resolve_attention
from convert.errors import ConvertError
from convert.hf import build_causal_lm, hf_config, load_strict
from convert.io.reader import dtype_itemsize
from convert.layouts import attention_view
from convert.options import dtype_name
from convert.plan import make_plan, resolve_spec
from convert.progress import progress
from convert.source import StateDictSource, check_layer, read_layer
from convert.targets.deepseek.rope import check_installed_rope, deepseek_rope_parameters, source_rope
from convert.targets.deepseek.tensors import (
    NORM_EXPONENT,
    DeepseekGeometry,
    attention_tensors,
    norm_constant,
    square_width,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


# Non-attention tensors a dense DeepseekV3ForCausalLM has under the same names.
_PASS_THROUGH = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
)


# Non-persistent buffers some old checkpoints still carry: recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


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


def as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype_name(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ConvertError(f"dtype {dtype!r} is not a torch dtype; use float32, bfloat16 or float64")
    return found


def export_spec(
    state_dict: "Mapping[str, torch.Tensor]", config, target: str, opts=None, spec: AttentionSpec | None = None
) -> tuple[dict, StateDictSource, AttentionSpec]:
    """(config dict, in-memory source, attention spec) of a model a DeepSeek-V3 target exports;
    refuses the families whose attention DeepSeek-V3 cannot hold (`SUPPORTED_ARCHS` only). With a
    conversion's `opts`, the spec takes its geometry flags and first meets its refusals and `check_deepseek`'s;
    a `spec` the caller has resolved that way already is used as it is."""
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    source = StateDictSource(state_dict, config)
    if spec is None and opts is not None:
        spec = resolve_spec(attention_view(source, config), config, opts)  # a fused qkv_proj seen split
        check_deepseek(spec, target)
    elif spec is None:
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


def to_deepseek_v3(
    state_dict: dict[str, torch.Tensor], config, dtype=None, spec: AttentionSpec | None = None
) -> tuple[dict, dict]:
    """Export a GQA model (Llama, Mistral, Qwen2) as an exact DeepseekV3ForCausalLM, in memory.

    state_dict: the source's tensors (HF names). config: its config.json dict or a
    transformers config. dtype: of the attention tensors written (and of every tensor:
    the others are cast when it differs); default the source's query weight dtype. spec: the
    source's attention spec where the caller has resolved it (a conversion's, its refusals met).

    Returns (state_dict, config_dict): the DeepseekV3ForCausalLM tensors (non-attention
    ones shared with the input when no cast is needed) and a complete config.json dict
    (`model_type: deepseek_v3`) that stock transformers loads without custom code; its
    `convert_export` entry records the construction. Raises ConvertError for what
    DeepSeek-V3 cannot hold exactly (docs/design.md, "Deployment targets").
    """
    config, source, spec = export_spec(state_dict, config, "transformers", spec=spec)
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
    check_installed_rope(ds_config, rope, spec.n_kv_heads)

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
