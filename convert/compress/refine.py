"""Attention-output refinement: each compressed layer fitted to what its attention computes.

After the closed-form factorization, Adam fits a layer's attention tensors so that the decoder layer, on the compressed
model's residual stream, outputs the original model's stream (where the attention's output enters the stream as it is),
or the compressed stream plus what the original layer adds to its own (where the decoder norms that output first)
(docs/compression.md, "Attention-output refinement").
"""

from dataclasses import dataclass

import torch

from convert.optim import relative_groups, warmup_cosine
from convert.stream import layer_output

#: Default steps per layer by the device that refines: a few seconds per SmolLM2 layer on 2 CPU cores.
REFINE_STEPS = {"cpu": 50, "cuda": 500}


def refine_device() -> torch.device:
    """Where layers are refined: the GPU when there is one (the calibration streams stay on the CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Refinement:
    """How long and how each layer's attention is refined (steps 0: not at all)."""

    steps: int = 0
    lr: float = 3e-3  # relative: each tensor's rate is this × its RMS (`convert.optim.relative_rates`)
    batch: int = 1  # calibration windows per step
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def sized(cls, steps: int | None) -> "Refinement":
        """`steps` (None: `REFINE_STEPS` for the device that refines) on `refine_device()`."""
        device = refine_device()
        return cls(steps=REFINE_STEPS[device.type] if steps is None else steps, device=str(device))


#: No refinement (steps 0).
NO_REFINEMENT = Refinement()


@dataclass
class Refined:
    """One layer's relative attention-output error before and after refinement (on every window), and
    the module's output as kept (B, L, D), where the caller asked for it: the forward that measured
    `after` is the one a sequential calibration advances its stream with."""

    before: float
    after: float
    output: torch.Tensor | None = None


def _moved(value, device: torch.device):
    """`value` with its tensors (also inside tuples) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value


def _rows(value, index: torch.Tensor, batch: int):
    """`value` (a tensor, tuple or other) with its batch rows `index` where its first dim is the batch."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.index_select(0, index)
    if isinstance(value, tuple):
        return tuple(_rows(v, index, batch) for v in value)
    return value


def _error(module, kwargs: dict, target: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """‖module(**kwargs) − target‖² relative to ‖target − base‖² (what the module should add to `base`; None: 0)."""
    return _relative(layer_output(module(**kwargs)), target, base)


def _relative(output: torch.Tensor, target: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """‖output − target‖² relative to ‖target − base‖² (`_error` of an output already computed)."""
    scale = target if base is None else target - base
    return (output - target).pow(2).sum() / scale.pow(2).sum()


def refine_attention(
    attention: torch.nn.Module,
    kwargs: dict,
    target: torch.Tensor,
    how: Refinement,
    within: torch.nn.Module | None = None,
    base: torch.Tensor | None = None,
    keep_output: bool = False,
) -> Refined:
    """Fit `attention`'s parameters (but those named by its `untrained_parameters` suffixes) in place so
    that `attention(**kwargs)[0]` matches `target` (B, L, D) or, given `within` (the decoder layer that
    calls `attention`, its other tensors left as they are), so that `within(**kwargs)`'s output does, the
    error then relative to what the layer adds to `base` (its input, B, L, D): `how.steps` Adam steps over
    `how.batch` random windows each, each tensor's learning rate `how.lr` × its RMS, warmed up over the
    first tenth and decayed to zero on a cosine, on `how.device` (the modules come back where they were).
    Where the error on every window is not lower after, the tensors are restored. keep_output: the
    result carries the module's output on every window as kept (`Refined.output`, on the module's device)."""
    module = attention if within is None else within
    home = next(module.parameters()).device
    device = torch.device(how.device)
    module.to(device)
    kwargs = {name: _moved(value, device) for name, value in kwargs.items()}
    target = target.to(device)
    base = None if base is None else base.to(device)
    batch = target.shape[0]
    with torch.no_grad():
        output = layer_output(module(**kwargs))  # (B, L, D)
        before = float(_relative(output, target, base))
    if how.steps <= 0:
        module.to(home)
        return Refined(before, before, output.to(home) if keep_output else None)
    del output
    start = {name: t.detach().clone() for name, t in attention.state_dict().items()}
    skips = tuple(getattr(attention, "untrained_parameters", ()))  # name suffixes left as they are
    params = [p for name, p in attention.named_parameters() if p.is_floating_point() and not name.endswith(skips)]
    for p in module.parameters():  # no gradient for what is not trained (the layer's norms and MLP)
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(relative_groups(params, how.lr))
    warmup = max(1, how.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, how.steps, warmup))
    generator = torch.Generator().manual_seed(how.seed)
    for _ in range(how.steps):
        index = torch.randperm(batch, generator=generator)[: how.batch].to(device)
        rows = {name: _rows(value, index, batch) for name, value in kwargs.items()}
        window_base = None if base is None else base.index_select(0, index)
        loss = _error(module, rows, target.index_select(0, index), window_base)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        output = layer_output(module(**kwargs))  # (B, L, D)
        after = float(_relative(output, target, base))
        if not after < before:  # kept only where it measures better
            attention.load_state_dict(start)
            after = before
            output = layer_output(module(**kwargs)) if keep_output else None
    module.to(home)
    return Refined(before, after, output.to(home) if keep_output else None)
