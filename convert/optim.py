"""Optimiser pieces shared by healing (`convert.healing`) and layer refinement (`convert.compress.refine`):
learning rates relative to each tensor's scale, and the warmup-cosine schedule."""

import math


def relative_rates(parameters, lr: float) -> list[float]:
    """Each tensor's learning rate: lr × its RMS (an all-zero tensor, e.g. a bias the conversion left
    at 0, takes the median RMS of the others). Adam moves every entry by about its learning rate
    whatever the gradient's scale, so an absolute rate would move a tensor of small entries far more,
    relatively, than one of large entries (a vllm export's o_proj is ~1e8, its kv_b_proj ~0.03)."""
    rms = [float(p.detach().float().pow(2).mean().sqrt()) for p in parameters]
    nonzero = sorted(r for r in rms if r > 0)
    fallback = nonzero[len(nonzero) // 2] if nonzero else 1.0
    return [lr * (r if r > 0 else fallback) for r in rms]


def relative_groups(parameters, lr: float) -> list[dict]:
    """One AdamW group per tensor at its `relative_rates` rate."""
    parameters = list(parameters)
    return [{"params": [p], "lr": rate} for p, rate in zip(parameters, relative_rates(parameters, lr))]


def warmup_cosine(step: int, steps: int, warmup: int = 10) -> float:
    """The learning rate's factor at `step`: linear warmup over `warmup` steps, then a cosine to 0."""
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
