"""The healing loop, on Hugging Face accelerate: KL distillation of the MLA projections toward the
original's logits, in one process (CPU or one GPU) or many (`accelerate launch` / `torchrun`: data
parallel, FSDP on GPUs). Each step trains on one global batch of windows (`--batch-size` per
micro-batch × `--grad-accum` × processes), the same windows in the same order whatever the number
of processes; the teacher's logits are computed on the fly by a frozen copy on every device."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import is_tensorboard_available
from torch.optim.lr_scheduler import LambdaLR

from convert.errors import ConvertError, EnvironmentFailure
from convert.healing.data import WindowsInMemory, WindowsStreamed, rank_samples
from convert.healing.objective import (
    Backtracking,
    distillation_loss,
    healing_optimizer,
    healing_scheduler,
    held_out_kl,
    schedule_at,
)
from convert.healing.state import TrainingState, latest_checkpoint, load_checkpoint, save_checkpoint
from convert.options import HealOptions
from convert.progress import phase, progress
from convert.verify.e2e import compare_models


def _measure(original, model, ids: torch.Tensor, window: int) -> dict:
    was_training = model.training
    model.eval()
    figures = compare_models(original, model, ids, window=window)
    model.train(was_training)
    keys = ("ppl_original", "ppl_converted", "ppl_ratio", "kl_mean", "top1_agreement")
    return {key: figures[key] for key in keys}


#: The most tokens the checks measure (a sixteenth of --text below 524,288 tokens): each check runs them.
CHECK_TOKENS = 32768


def make_accelerator(opts: HealOptions, project_dir: Path | None):
    """The `Accelerator` of this run: the processes `accelerate launch` / `torchrun` started (one
    when launched plainly), on `opts.device`, in `opts.mixed_precision`, logging to the trackers
    `opts.log_with` names under `project_dir`. An FSDP config on CPUs is refused (accelerate shards
    only on accelerators; it would train unsharded without a word)."""
    device = opts.torch_device
    if "WORLD_SIZE" not in os.environ:
        AcceleratorState._reset_state(True)  # a fresh single-process state per call (tests, notebooks)
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and device.type == "cpu":
        raise EnvironmentFailure(
            "FSDP (ACCELERATE_USE_FSDP) asked for on CPUs: accelerate shards models on GPUs only; "
            "drop the FSDP config to train data parallel on CPUs, or run on GPUs"
        )
    mixed = mixed_precision(opts)
    trackers = _trackers(opts.log_with) if project_dir is not None else []
    return Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=mixed,
        log_with=trackers or None,
        project_dir=None if project_dir is None else str(project_dir),
    )


def mixed_precision(opts: HealOptions) -> str:
    """accelerate's mixed precision for `opts`: `auto` is bf16 on CUDA, none on the CPU."""
    if opts.mixed_precision != "auto":
        return opts.mixed_precision
    return "bf16" if opts.torch_device.type == "cuda" else "no"


def _trackers(log_with: str) -> list[str]:
    """The trackers to log to: `auto` is TensorBoard when it is installed, else none."""
    if log_with == "none":
        return []
    if log_with == "auto":
        return ["tensorboard"] if is_tensorboard_available() else []
    return [log_with]


def train(model, original, train, eval_ids: torch.Tensor, opts: HealOptions, state_dir: Path | None = None):
    """Distil `model` toward `original` in place; figures on `eval_ids` (1, N).

    train: token ids (1, N) (with `opts.check_every`, their last sixteenth is held out for the
    checks) or a `WindowsStreamed`. Only `trainable_parameters(model)` change (AdamW, gradients
    clipped to norm 1, each tensor's rate `relative_rates`, warmed up over 10 steps and decayed to 0
    on a cosine); every parameter's `requires_grad` is restored afterwards. With `opts.check_every`
    the model returned is the best one on the check tokens (`Backtracking`), the unhealed one
    included. With `state_dir`, a checkpoint every `opts.save_every` steps, `opts.resume` continues
    from the latest, and the trackers log there. Returns the report's figures and the Accelerator.
    """
    assert opts.steps is not None and opts.window is not None and opts.batch_size is not None  # HealOptions.sized()
    accelerator = make_accelerator(opts, state_dir)
    device = accelerator.device
    windows, check_ids, train_tokens = _training_windows(train, opts)
    eval_ids = eval_ids.to(device)
    check_ids = None if check_ids is None else check_ids.to(device)
    original.to(device).requires_grad_(False).eval()
    model.to(device)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    optimizer = healing_optimizer(model, opts.lr)  # freezes all but `trainable_parameters(model)`
    if opts.gradient_checkpointing:
        _checkpointing(model, True)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    live = accelerator.unwrap_model(prepared)
    trainable = {name: p for name, p in live.named_parameters() if p.requires_grad}
    shown = opts.progress and accelerator.is_main_process
    with phase("held-out figures before healing", shown):
        before = _measure(original, live, eval_ids, opts.eval_window)
    track: Backtracking | None = None
    if check_ids is not None:
        track = Backtracking(trainable, optimizer, lambda: held_out_kl(original, live, check_ids, opts.window))
    scheduler = healing_scheduler(optimizer, opts.steps, track)
    run = _started(opts, state_dir, accelerator, trainable, optimizer, track)
    schedule_at(scheduler, run.step)
    if track:
        track.scheduler = scheduler
    global_batch = opts.batch_size * opts.grad_accum * accelerator.num_processes
    if state_dir is not None and accelerator.log_with:
        accelerator.init_trackers("convert-heal", config=_flat(opts))
    steps = _Steps(accelerator, prepared, original, windows, trainable, optimizer, scheduler, track)
    try:
        steps.run(run, opts, state_dir, shown)
    finally:
        if opts.gradient_checkpointing:
            _checkpointing(live, False)
        for name, p in live.named_parameters():
            p.requires_grad_(flags.get(name, p.requires_grad))
        live.eval()
    with phase("held-out figures after healing", shown):
        after = _measure(original, live, eval_ids, opts.eval_window)
    if accelerator.log_with:
        accelerator.log({"held_out/ppl_ratio": after["ppl_ratio"], "held_out/kl": after["kl_mean"]}, step=opts.steps)
        accelerator.end_training()
    # The model's own forward again: accelerate wrapped it in the run's autocast (bf16), which would
    # otherwise stay on the healed module its caller gets back (logits 1% off its own weights').
    accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    texts = {"train_tokens": train_tokens, "eval_tokens": int(eval_ids.shape[-1])}
    held_out = {"before": before, "after": after}
    return _figures(opts, accelerator, run, steps, global_batch, check_ids, texts, held_out), accelerator


def _started(
    opts: HealOptions, state_dir: Path | None, accelerator, trainable: dict, optimizer, track
) -> TrainingState:
    """The run's state: new, or with `opts.resume` the latest checkpoint's (weights, optimizer and
    checks restored in place)."""
    if not opts.resume:
        return TrainingState(world=accelerator.num_processes)
    found = latest_checkpoint(state_dir)
    if found is None:
        raise ConvertError(f"--resume: no checkpoint in {state_dir}; run without --resume to start")
    return load_checkpoint(found, accelerator, trainable, optimizer, track, _signature(opts, accelerator))


@dataclass
class _Steps:
    """The healing loop's parts, prepared by `train`: what one optimizer step touches."""

    accelerator: Accelerator
    prepared: torch.nn.Module  # the model as accelerate wraps it
    original: torch.nn.Module
    windows: WindowsInMemory | WindowsStreamed
    trainable: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    track: Backtracking | None

    def run(self, run: TrainingState, opts: HealOptions, state_dir: Path | None, shown: bool) -> None:
        """Steps `run.step` to `opts.steps`: each recorded in `run`, checked, logged and saved as asked."""
        assert opts.steps is not None and opts.batch_size is not None  # set by HealOptions.sized()
        accelerator, track = self.accelerator, self.track
        global_batch = opts.batch_size * opts.grad_accum * accelerator.num_processes
        window_tokens = opts.batch_size * opts.grad_accum * self.windows.window  # per process and step
        start, seconds_before = time.perf_counter(), run.seconds
        self.prepared.train()
        bar = progress(range(run.step, opts.steps), "healing", "step", shown, total=opts.steps - run.step)
        for step in bar:
            samples = rank_samples(step, global_batch, accelerator.process_index, accelerator.num_processes)
            batch = self.windows.batch(samples).to(accelerator.device)  # (B·A, window)
            loss = _train_step(accelerator, self.prepared, self.original, batch, opts)
            accelerator.clip_grad_norm_(list(self.trainable.values()), 1.0)
            factor = self.scheduler.lr_lambdas[0](step)  # the rate's factor this step trained at
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            kl = float(accelerator.reduce(loss, "mean"))
            seconds = seconds_before + time.perf_counter() - start
            run.record(step, kl, factor, seconds)
            if track and ((step + 1) % opts.check_every == 0 or step + 1 == opts.steps):
                track.check(step + 1)  # the last step is checked too: the model ends at the best weights
            rate = (step + 1) * window_tokens * accelerator.num_processes / seconds
            bar.set_postfix({"kl": f"{kl:.4f}", "tokens/s": f"{rate:.0f}"})
            if accelerator.log_with:
                accelerator.log({"train/kl": kl, "train/lr_factor": factor, "train/tokens_per_s": rate}, step=step + 1)
            if (
                state_dir is not None
                and opts.save_every
                and (step + 1) % opts.save_every == 0
                and step + 1 < opts.steps
            ):
                run.step, run.seconds = step + 1, seconds
                signature = _signature(opts, accelerator)
                save_checkpoint(state_dir, accelerator, run, self.trainable, self.optimizer, track, signature)
        run.step, run.seconds = opts.steps, seconds_before + time.perf_counter() - start


def _figures(
    opts: HealOptions, accelerator, run: TrainingState, steps: _Steps, global_batch: int, check_ids, texts, held_out
) -> dict:
    """The report's figures of a finished run: its settings, the training's, `texts` (train_tokens,
    eval_tokens) and the `held_out` figures (before, after)."""
    assert opts.steps is not None  # set by HealOptions.sized()
    device, window = accelerator.device, steps.windows.window
    return {
        "steps": opts.steps,
        "lr": opts.lr,
        "window": opts.window,
        "eval_window": opts.eval_window,
        "batch_size": opts.batch_size,
        "grad_accum": opts.grad_accum,
        "processes": accelerator.num_processes,
        "global_batch_windows": global_batch,
        "mixed_precision": accelerator.mixed_precision,
        "distributed": str(accelerator.distributed_type).split(".")[-1],
        "seed": opts.seed,
        "train_tokens": texts["train_tokens"],
        "tokens_trained": opts.steps * global_batch * window,
        "eval_tokens": texts["eval_tokens"],
        "trained_parameters": sum(p.numel() for p in steps.trainable.values()),
        "train_kl_first": run.history[0]["kl"] if run.history else None,
        "train_kl_last": run.history[-1]["kl"] if run.history else None,
        "history": run.history,
        "checks": steps.track.report(int(check_ids.shape[-1])) if steps.track else None,
        "seconds": run.seconds,
        "tokens_per_second": opts.steps * global_batch * window / run.seconds if run.seconds else None,
        "device": str(device),
        "peak_device_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        **held_out,
    }


def _train_step(accelerator, model, original, batch: torch.Tensor, opts: HealOptions) -> torch.Tensor:
    """Forward and backward of this process's share of a step, `opts.grad_accum` micro-batches of
    `opts.batch_size` windows (gradients synchronised on the last): the mean KL it trained on."""
    assert opts.batch_size is not None  # set by HealOptions.sized()
    losses = []
    for m in range(opts.grad_accum):
        micro = batch[m * opts.batch_size : (m + 1) * opts.batch_size]  # (B, window)
        with torch.no_grad(), accelerator.autocast():
            teacher = original(micro).logits  # (B, window, V)
        sync = m == opts.grad_accum - 1
        with nullcontext() if sync else accelerator.no_sync(model):
            loss = distillation_loss(model(micro).logits, teacher)
            accelerator.backward(loss / opts.grad_accum)
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _checkpointing(model, on: bool) -> None:
    """Activation (gradient) checkpointing of the decoder layers on or off (transformers 5.x names
    it activation_checkpointing, older releases gradient_checkpointing)."""
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"
    if on:
        getattr(model, f"{name}_enable")(**{f"{name}_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_disable")()


def _training_windows(train, opts: HealOptions):
    """The windows to train on, the check tokens (or None) and the count of training tokens."""
    assert opts.window is not None  # set by HealOptions.sized()
    if isinstance(train, WindowsStreamed):
        check = train.held_out_ids() if opts.check_every else None
        return train, check, None
    ids = train.reshape(1, -1)  # (1, N)
    check = None
    if opts.check_every:
        ids, check = hold_out(ids, 16, "check tokens", "pass --check-every 0", most=CHECK_TOKENS)
    return WindowsInMemory(ids, opts.window, opts.seed), check, int(ids.shape[-1])


def hold_out(
    ids: torch.Tensor, part: int, what: str, fix: str, most: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` (1, N) split into its first tokens and its last 1/`part` (at most `most`), `what` (at
    least 2 tokens each)."""
    n_out = max(2, min(ids.shape[-1] // part, most or ids.shape[-1]))
    if ids.shape[-1] - n_out < 2:
        raise ConvertError(f"--text is too short to hold out {what}: give a longer text or {fix}")
    return ids[:, :-n_out], ids[:, -n_out:]


def _signature(opts: HealOptions, accelerator) -> dict:
    """What a checkpoint must share with the run that resumes it to continue the same run."""
    keys = ("steps", "lr", "window", "tokens", "check_every", "seed", "batch_size", "grad_accum")
    return {**{k: getattr(opts, k) for k in keys}, "processes": accelerator.num_processes}


def _flat(opts: HealOptions) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in asdict(opts).items()}
