"""The source's RoPE as transformers computes it (`SourceRope`), and as DeepSeek-V3's config
must say it for the export to rotate the same: inverse frequencies, longrope's two sets, yarn's
multiplier, and the check that the built model installed them."""

from dataclasses import dataclass

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from convert.errors import ConvertError
from convert.hf import hf_classes
from convert.rope.frequencies import longrope_factors, longrope_inv_freq

# Source RoPE types whose inverse frequencies are fixed at load time (longrope: two fixed sets).
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
        long_inv_freq = longrope_inv_freq(hf_config, original_max)
    return SourceRope(rope_type, inv_freq, long_inv_freq, float(rotary.attention_scaling), int(original_max))


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


def check_installed_rope(config, rope: SourceRope, n_kv_heads: int) -> None:
    """The installed DeepseekV3 rotary gives the source's frequencies: transformers is the truth."""
    rotary = DeepseekV3RotaryEmbedding(config)
    long = longrope_inv_freq(config, rope.original_max_position_embeddings)
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
