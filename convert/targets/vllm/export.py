"""The export as a stream: `vllm_export` gives its layout and config, then its tensors one decoder
layer at a time; `to_vllm_deepseek` the same in memory."""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DeepseekV3Config

from convert.arch import AttentionSpec
from convert.hf import hf_config
from convert.rope import config as rope_config
from convert.rope.frequencies import fold
from convert.source import StateDictSource, check_layer, read_layer
from convert.targets.deepseek import as_dtype, check_exportable, deepseek_config_fields, export_spec, pass_through_names
from convert.targets.vllm.bias import bias_summary, carried_biases, key_bias_slots
from convert.targets.vllm.calibration import SequentialLatents, position_free_stand_in
from convert.targets.vllm.geometry import (
    KV_LORA_RANK,
    LATENT_DIMS,
    NORM_EPS,
    NORM_ROWS,
    ROPE_DIM,
    cache_values_per_layer,
    latent_content_rank,
    vllm_geometry,
)
from convert.targets.vllm.latent import LatentFit, attention_tensors
from convert.targets.vllm.rope import (
    check_vllm_exportable,
    export_rope_parameters,
    needs_calibration,
    rope_frequencies,
)
from convert.targets.vllm.rotary import rotary_directions

if TYPE_CHECKING:
    from collections.abc import Mapping

    from transformers import PretrainedConfig


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
    shrinkage: --shrinkage, of a compressed latent's statistics (`LatentFit`). rope_dim: the shared rotary
    key's width, vLLM's 64 (`ROPE_DIM`); llama.cpp reads it from the file, and at head_dim each source
    pair keeps its own frequency (fold 1: only the key heads' mixture is lossy).
    """

    stats: list | None = None
    dtype: torch.dtype | str | None = None
    stand_in: str = "fit"
    span: int = 1024
    rank: int = LATENT_DIMS
    sequential: "SequentialLatents | None" = None
    shrinkage: float = 0.0
    rope_dim: int = ROPE_DIM


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
    dtype = as_dtype(choices.dtype) or source.dtype(spec.tensor(0, "q"))
    check_vllm_exportable(config, spec, source, dtype, choices.stats is not None, choices.rope_dim)
    return stream_export(state_dict, config, source, spec, choices)


def resolve_vllm_spec(state_dict: "Mapping[str, torch.Tensor]", config) -> tuple[dict, StateDictSource, AttentionSpec]:
    """(config dict, in-memory source, attention spec) of a model the vllm target exports."""
    return export_spec(state_dict, config, "vllm")


def stream_export(state_dict, config: dict, source: StateDictSource, spec: AttentionSpec, choices: ExportChoices):
    """`vllm_export` of a source already resolved and refused by `check_vllm_exportable`."""
    hf_src = hf_config(config)
    dtype = as_dtype(choices.dtype) or source.dtype(spec.tensor(0, "q"))
    check_exportable(hf_src, dtype if dtype != torch.float16 else torch.float32)
    if not 0 < choices.rank <= LATENT_DIMS:
        raise ValueError(
            f"rank {choices.rank}: the latent holds 1 to {LATENT_DIMS} dims ({NORM_ROWS} of vLLM's {KV_LORA_RANK} carry "
            "the latent norm's constant for transformers)"
        )
    names = pass_through_names(state_dict, spec)
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)

    geo, rope_dim = vllm_geometry(spec, choices.rope_dim), choices.rope_dim
    q_scale = spec.softmax_scale * math.sqrt(geo["nope"] + geo["rope"])  # DeepSeek's scale is 1/sqrt(nope + rope)
    s = math.sqrt(NORM_EPS / hf_src.rms_norm_eps)
    attention = {
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": rope_dim,
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
            prefix + "q_proj.weight": ((H * (d + rope_dim), hidden), dtype),
            prefix + "kv_a_proj_with_mqa.weight": ((KV_LORA_RANK + rope_dim, hidden), dtype),
            prefix + "kv_a_proj_with_mqa.bias": ((KV_LORA_RANK + rope_dim,), dtype),
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

    state_dict: "Mapping[str, torch.Tensor]"
    source: StateDictSource
    spec: AttentionSpec
    hf_src: "PretrainedConfig"  # the source's transformers config
    config: dict
    result: dict  # the export's config.json (its convert_export filled by `_export_tensors`)
    names: list  # pass-through tensors
    head: str | None  # the source's untied lm_head, or None (the embedding)
    dtype: torch.dtype
    s: float  # residual scale
    q_scale: float


def _export_tensors(plan: _ExportPlan, choices: ExportChoices):
    """`vllm_export`'s tensors, in `layout`'s order (the pass-through ones, lm_head, the layers')."""
    spec, dtype, s = plan.spec, plan.dtype, plan.s
    stats, sequential = choices.stats, choices.sequential
    for name in plan.names:
        scale = s if name == "model.embed_tokens.weight" or name.endswith("mlp.down_proj.weight") else None
        yield name, _cast(plan.state_dict[name], dtype, scale)
    yield "lm_head.weight", _cast(plan.state_dict[plan.head or "model.embed_tokens.weight"], dtype)
    rope_dim = choices.rope_dim
    inv_freq, rotary_freq = rope_frequencies(plan.hf_src, spec.head_dim, rope_dim)  # (d/2,) each
    bias_slots = key_bias_slots(rotary_freq, fold(spec.head_dim, rope_dim), choices.span)  # (rope_dim/2,)
    carried: list[dict[str, float]]  # the bias figures of the layers with biases (`carried_biases`)
    retained, fitted, compressed, carried = [], [], [], []
    for layer in range(spec.n_layers):
        weights = read_layer(plan.source, spec, layer)
        layer_stats = stats[layer] if stats is not None else None
        u, kept = rotary_directions(weights, spec, layer_stats.moment if layer_stats is not None else None, rope_dim)
        carrier, weights = carried_biases(weights, layer_stats, carried)
        retained.append(kept)
        terms = position_free_stand_in(choices.stand_in, layer_stats, spec.n_heads, inv_freq, choices.span)
        fitted.append(terms is not None)
        inputs = sequential.stats(layer) if sequential is not None else None
        latent = LatentFit(choices.rank, layer_stats, inputs, choices.shrinkage, rope_dim)
        tensors, squeezed = attention_tensors(weights, spec, u, plan.q_scale, s, terms, latent, carrier, bias_slots)
        compressed.append(squeezed)
        if sequential is not None:
            tensors = sequential.advance(layer, tensors, plan.result, s, refine=squeezed)
        for name, tensor in tensors.items():
            yield spec.prefix(layer) + name, tensor.to(dtype).contiguous()
    plan.result["convert_export"] = _export_record(plan, choices, retained, fitted, compressed, carried, bias_slots)


def _export_record(
    plan: _ExportPlan, choices: ExportChoices, retained, fitted, compressed, carried, bias_slots: torch.Tensor
) -> dict:
    """The export's `convert_export` record: how it was made and what it keeps, per layer; `bias_slots`:
    the rotary slots a key bias rides in (`key_bias_slots`)."""
    spec, config, hf_src, stats, sequential = plan.spec, plan.config, plan.hf_src, choices.stats, choices.sequential

    rope_dim = choices.rope_dim
    exact = not needs_calibration(spec, config, bool(carried), rope_dim) and not any(compressed)
    biases = bias_summary(carried)
    if carried and "k" in carried[0]:
        assert biases is not None  # carried is not empty
        biases["key_bias_rotary_slots"] = int(bias_slots.sum())
    return {
        "target": "vllm",
        "source_model_type": config.get("model_type"),
        "residual_scale": plan.s,
        "source_rms_norm_eps": hf_src.rms_norm_eps,
        "q_scale": plan.q_scale,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "exact": exact,
        "frequency_fold": fold(spec.head_dim, rope_dim),
        "rotary_key_energy_kept": retained,
        "position_free_terms": "exact" if exact else (choices.stand_in if all(fitted) else "nope"),
        "source_rope_type": rope_config.rope_type(config),
        "latent_content_dims": latent_content_rank(spec, rope_dim),
        "latent_dims_used": min(choices.rank, latent_content_rank(spec, rope_dim), spec.hidden_size),
        "latent_compressed": any(compressed),
        "latent_weighting": _weighting_name(stats) if any(compressed) else None,
        "latent_calibration": (
            ("sequential" if sequential is not None and sequential.refit else "original") if any(compressed) else None
        ),
        # Adam steps per compressed layer fitting its attention output (convert.compress.refine)
        "latent_refine_steps": sequential.refine_steps if sequential is not None and any(compressed) else 0,
        "kv_cache_dims_per_token_per_layer": cache_values_per_layer(rope_dim),
        "gqa_cache_dims_per_token_per_layer": 2 * spec.n_kv_heads * spec.head_dim,
        # q/k/v biases carried in the weights (convert.targets.vllm.bias): per layer, the share of a bias
        # left out and each projection's relative output error from it
        "attention_biases": biases,
    }


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
