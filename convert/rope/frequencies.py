"""RoPE's frequencies: θ_j of default RoPE, those transformers computes for every scaling, the
factors that reproduce a set of them exactly, and how many source pairs fold into one rotary slot."""

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """θ_j of default RoPE, (d/2,) float64: pair j = (j, j + d/2) turns by θ_j per position."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def transformers_inv_freq(config, dim: int) -> torch.Tensor:
    """(dim/2,) float64 inverse frequencies of a transformers config's `rope_parameters` (any scaling, as
    transformers' RoPE init computes it; default RoPE as `inv_freq`). `dim` is given, not read from the
    config: published Qwen2/Mistral configs have no head_dim."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq(float(config.rope_parameters["rope_theta"]), dim)
    return ROPE_INIT_FUNCTIONS[rope_type](config)[0].double()


def longrope_inv_freq(config, original_max_position_embeddings: int) -> torch.Tensor:
    """The long-context inverse frequencies (d/2,) float32 transformers' longrope computes for a config
    (the set it turns to above `original_max_position_embeddings`)."""
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original_max_position_embeddings + 1)
    return long.to(torch.float32)


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


def fold(head_dim: int, rope_dim: int) -> int:
    """How many source frequency pairs share one of a `rope_dim`-dim rotary key's rope_dim/2 slots:
    f = d / rope_dim (vLLM's 64 dims: 32 slots; llama.cpp reads the width from the file: d dims, f = 1)."""
    return head_dim // rope_dim
