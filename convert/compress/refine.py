"""Attention-output refinement: each compressed layer fitted to what its attention computes.

After the closed-form factorization, Adam fits a layer's attention tensors so that the decoder layer, on the compressed
model's residual stream, outputs the original model's stream (where the attention's output enters the stream as it is),
or the compressed stream plus what the original layer adds to its own (where the decoder norms that output first)
(docs/compression.md, "Attention-output refinement").
"""

import inspect
from dataclasses import dataclass

import torch

from convert.mla.kernels import causal_mask
from convert.optim import relative_groups, warmup_cosine
from convert.stream import layer_output

#: Default steps per layer by the device that refines, each of `REFINE_QUERIES` positions (None: all) of a
#: window: about 5 s per SmolLM2 layer on 2 CPU cores (docs/compression.md, "Steps on some positions").
REFINE_STEPS = {"cpu": 100, "cuda": 500}
REFINE_QUERIES = {"cpu": 128, "cuda": None}


def refine_device() -> torch.device:
    """Where layers are refined: the GPU when there is one (the calibration streams stay on the CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Refinement:
    """How long and how each layer's attention is refined (steps 0: not at all)."""

    steps: int = 0
    lr: float = 3e-3  # relative: each tensor's rate is this × its RMS (`convert.optim.relative_rates`)
    batch: int = 1  # calibration windows per step
    # query positions per step (None: every position), each attending to its whole window's keys
    # (modules that take `key_states`: `convert.mla.attention.MLAAttention`, the vllm export's
    # `ExportAttention`; others fit every position)
    queries: int | None = None
    # calibration windows (the first) on which the error before and after decides whether the fit is kept
    checked: int = 4
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def sized(cls, steps: int | None, queries: int | None = None) -> "Refinement":
        """`steps` of `queries` positions (None: `REFINE_STEPS`, `REFINE_QUERIES` for the device that
        refines) on `refine_device()`."""
        device = refine_device().type
        steps = REFINE_STEPS[device] if steps is None else steps
        return cls(steps=steps, queries=REFINE_QUERIES[device] if queries is None else queries, device=device)


#: No refinement (steps 0).
NO_REFINEMENT = Refinement()


@dataclass
class Refined:
    """One layer's relative attention-output error before and after refinement (on the checked windows), and
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


class _Reached(Exception):
    """Raised by `_attention_inputs`' hook: the layer has reached its attention, and stops there."""


def _attention_inputs(module: torch.nn.Module, attention: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    """The hidden states (B, L, D) that `attention` is called with when `module` runs on `kwargs`: the
    layer runs up to its attention (its input norm) and stops there."""
    seen: list[torch.Tensor] = []

    def reached(_module, args, called):
        seen.append(called["hidden_states"] if "hidden_states" in called else args[0])
        raise _Reached

    handle = attention.register_forward_pre_hook(reached, with_kwargs=True)
    try:
        with torch.no_grad():
            module(**kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    return seen[0]


def _at_queries(rows: dict, positions: torch.Tensor, keys: torch.Tensor, window: int | None) -> dict:
    """The layer's keyword arguments `rows` for query positions `positions` (Q,) alone, the attention's
    keys and values still from every position of its input `keys` (B, L, D): the hidden states, cos/sin,
    position ids and mask rows of those positions, the keys' own beside them."""
    hidden, rotary, mask = rows["hidden_states"], rows.get("position_embeddings"), rows.get("attention_mask")
    length = hidden.shape[1]
    if mask is None:  # the module's own causal mask (and window) over the whole window, before taking rows
        mask = causal_mask(length, length, hidden, window)  # (L, L)
    subset = dict(rows, hidden_states=hidden[:, positions], attention_mask=mask[..., positions, :])
    subset |= {"key_states": keys, "key_position_embeddings": rotary}
    if rotary is not None:
        subset["position_embeddings"] = tuple(t[..., positions, :] for t in rotary)  # (B|1, Q, d)
    if rows.get("position_ids") is not None:  # the keys' own for a module that turns them itself
        subset |= {"position_ids": rows["position_ids"][..., positions], "key_position_ids": rows["position_ids"]}
    return subset


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
    `how.batch` random windows each (`how.queries` of their positions), each tensor's learning rate
    `how.lr` × its RMS, warmed up over the first tenth and decayed to zero on a cosine, on `how.device`
    (the modules come back where they were). Where the error on the first `how.checked` windows is not
    lower after, the tensors are restored. keep_output: the result carries the module's output on every
    window as kept (`Refined.output`, on the module's device)."""
    module = attention if within is None else within
    home = next(module.parameters()).device
    device = torch.device(how.device)
    module.to(device)
    fit = _Fit(
        module,
        attention,
        {name: _moved(value, device) for name, value in kwargs.items()},
        target.to(device),
        None if base is None else base.to(device),
    )
    checked = torch.arange(min(fit.batch, how.checked), device=device)  # the windows that decide
    output: torch.Tensor | None  # None once not needed (not kept)
    with torch.no_grad():
        output = fit.output(None if keep_output and how.steps <= 0 else checked)  # (B or checked, L, D)
        before = fit.error(output[: len(checked)], checked)
    if how.steps > 0:
        start = {name: t.detach().clone() for name, t in attention.state_dict().items()}
        fit.steps(how)
        with torch.no_grad():
            output = fit.output(None if keep_output else checked)  # (B or checked, L, D)
            after = fit.error(output[: len(checked)], checked)
            if not after < before:  # kept only where it measures better
                attention.load_state_dict(start)
                after = before
                output = fit.output(None) if keep_output else None
    else:
        after = before
    module.to(home)
    if not keep_output:
        return Refined(before, after, None)
    assert output is not None  # kept: every path above ends on the output of all the windows
    return Refined(before, after, output.to(home))


class _Fit:
    """One layer's refinement problem: `module` (the decoder layer, or the attention itself) run on
    `kwargs` (B windows) should output `target`, relative to what it adds to `base`."""

    def __init__(self, module, attention, kwargs: dict, target: torch.Tensor, base: torch.Tensor | None):
        self.module, self.attention, self.kwargs, self.target, self.base = module, attention, kwargs, target, base
        self.batch, self.length = target.shape[:2]

    def rows(self, index: torch.Tensor | None) -> dict:
        """The keyword arguments of windows `index` (None: all)."""
        return self.kwargs if index is None else {n: _rows(v, index, self.batch) for n, v in self.kwargs.items()}

    def output(self, index: torch.Tensor | None) -> torch.Tensor:
        """The module's output on windows `index` (None: all), (B', L, D)."""
        return layer_output(self.module(**self.rows(index)))

    def error(self, output: torch.Tensor, index: torch.Tensor) -> float:
        """The relative error of `output` (the module's on windows `index`)."""
        return float(_relative(output, self.target[index], None if self.base is None else self.base[index]))

    def steps(self, how: Refinement) -> None:
        """`how.steps` Adam steps on the attention's trained tensors, then none left trainable."""
        skips = tuple(getattr(self.attention, "untrained_parameters", ()))  # name suffixes left as they are
        named = self.attention.named_parameters()
        params = [p for name, p in named if p.is_floating_point() and not name.endswith(skips)]
        for p in self.module.parameters():  # no gradient for what is not trained (the layer's norms and MLP)
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(relative_groups(params, how.lr))
        warmup = max(1, how.steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, how.steps, warmup))
        generator = torch.Generator().manual_seed(how.seed)
        queries = how.queries if how.queries is not None and how.queries < self.length else None
        if "key_states" not in inspect.signature(self.attention.forward).parameters:
            queries = None  # a module that takes its keys from its queries' hidden states only
        keys = None if queries is None else _attention_inputs(self.module, self.attention, self.kwargs)  # (B, L, D)
        for _ in range(how.steps):
            index = torch.randperm(self.batch, generator=generator)[: how.batch].to(self.target.device)
            positions = None
            if queries is not None:  # (Q,) positions, in order
                positions = torch.randperm(self.length, generator=generator)[:queries].sort().values
                positions = positions.to(self.target.device)
            loss = self.step_error(index, positions, keys)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        for p in params:
            p.requires_grad_(False)

    def step_error(self, index: torch.Tensor, positions: torch.Tensor | None, keys) -> torch.Tensor:
        """The error on windows `index`, at query `positions` (None: all) whose keys come from every
        position of the attention's inputs `keys` (B, L, D)."""
        rows, target = self.rows(index), self.target.index_select(0, index)
        base = None if self.base is None else self.base.index_select(0, index)
        if positions is not None:
            window = getattr(self.attention, "sliding_window", None)
            rows = _at_queries(rows, positions, keys.index_select(0, index), window)
            target, base = target[:, positions], None if base is None else base[:, positions]
        return _error(self.module, rows, target, base)
