"""The source's RoPE as vLLM computes it for DeepSeek-V3 (default as it is, llama3 as DeepSeek-YaRN),
and the refusals of what vLLM would serve wrongly."""

import torch
from transformers import DeepseekV3Config

from convert.arch import AttentionSpec
from convert.errors import ConvertError
from convert.rope.config import rope_type as config_rope_type
from convert.rope.frequencies import fold, transformers_inv_freq
from convert.targets.vllm.bias import biased_projections
from convert.targets.vllm.geometry import DTYPES, ROPE_DIM


def check_vllm_exportable(
    config: dict, spec: AttentionSpec, source, dtype: torch.dtype, calibrated: bool, rope_dim: int = ROPE_DIM
) -> None:
    """Refuse, with one line each, what vLLM's MLA would serve wrongly or cannot hold (with a
    `rope_dim`-dim rotary key: vLLM's 64, or llama.cpp's head_dim)."""
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
    rope_type = config_rope_type(config)
    if rope_type not in ("default", "llama3"):
        raise ConvertError(
            f"config.json rope_type={rope_type!r}: vLLM rewrites any non-default RoPE of DeepSeek-V3 to "
            "DeepSeek-YaRN, which holds only default and llama3 RoPE sources; use --target transformers or --target mla"
        )
    if spec.head_dim % rope_dim:
        raise ConvertError(
            f"head_dim {spec.head_dim}: the vllm target needs a multiple of {ROPE_DIM} (vLLM's 64 rotary dims hold "
            f"32 frequency pairs; d = 64·f folds f source pairs into each); use --target transformers or --target mla"
        )
    if needs_calibration(spec, config, rope_dim=rope_dim) and not calibrated:
        raise ConvertError(
            f"{spec.n_kv_heads} key/value head(s) of head_dim {spec.head_dim}: the vllm target chooses which RoPE "
            "directions to keep from calibration statistics; give --calib TEXT (a real text, not the --text one)"
        )


def needs_calibration(
    spec: AttentionSpec, config: dict | None = None, biased: bool = False, rope_dim: int = ROPE_DIM
) -> bool:
    """More than one key pair per rotary slot (G > 1 or d > rope_dim), a source RoPE vLLM turns at
    other frequencies (llama3), or q/k/v biases (`biased`): the export is lossy and calibrated."""
    rope_type = config_rope_type(config) if config is not None else "default"
    return spec.n_kv_heads * fold(spec.head_dim, rope_dim) > 1 or rope_type != "default" or biased


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


def rope_frequencies(hf_src, head_dim: int, rope_dim: int = ROPE_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """(θ_j the source turns pair j by, θ'_j the export turns pair j's rotary key by), each (d/2,)
    float64, as transformers computes them (the source's rotary embedding; DeepseekV3's on the
    export's `rope_parameters` with a `rope_dim`-dim rotary key, slot s = pair j // f)."""
    source = transformers_inv_freq(hf_src, head_dim)  # (d/2,)
    export = DeepseekV3Config(
        qk_rope_head_dim=rope_dim,
        rope_parameters=export_rope_parameters(hf_src),
        max_position_embeddings=hf_src.max_position_embeddings,
    )
    slots = transformers_inv_freq(export, rope_dim)  # (rope_dim/2,)
    return source, slots.repeat_interleave(fold(head_dim, rope_dim))
