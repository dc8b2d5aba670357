"""The arithmetic of RoPE scalings that a file stores as numbers rather than names (no torch: GGUF
headers are read on the CLI's light path)."""

import math


def llama3_factors(theta: float, n_rot: int, factor: float, low: float, high: float, original: int) -> list[float]:
    """The frequency divisors llama.cpp's convert_hf_to_gguf.py writes as rope_freqs for a Llama 3
    rope_scaling (its `generate_extra_tensors`): pair i/2 of n_rot rotary dims is divided by
    `factor` where its wavelength is above original/low, kept below original/high, blended between."""
    out = []
    for i in range(0, n_rot, 2):
        wavelen = 2 * math.pi * theta ** (i / n_rot)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
