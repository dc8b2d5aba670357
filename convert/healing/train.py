"""The healing loop, on Hugging Face accelerate: KL distillation of the MLA projections toward the
original's logits, in one process (CPU or one GPU) or many (`accelerate launch` / `torchrun`: data
parallel, FSDP on GPUs). Each step trains on one global batch of windows (`--batch-size` per
micro-batch × `--grad-accum` × processes), the same windows in the same order whatever the number
of processes; the teacher's logits are computed on the fly by a frozen copy on every device."""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import is_tensorboard_available

from convert.errors import ConvertError, EnvironmentFailure
from convert.healing.data import WindowsInMemory, WindowsStreamed, rank_samples
from convert.healing.state import TrainingState, latest_checkpoint, load_checkpoint, save_checkpoint
from convert.options import HealOptions
from convert.progress import progress
from convert.verify.e2e import compare_models

#: Export tensors that hold the pass-through of DeepseekV3's latent norm (`convert.targets`): the norm
#: weights and the transformers target's constant bias row M. Never trained: a relative learning
#: rate would move their zero entries by ~1e-3·M.
_PASS_THROUGH = ("_layernorm.", "kv_a_proj_with_mqa.bias")


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The MLA projections: every parameter of an attention module (`*.self_attn.*`) but a
    DeepSeek-V3 export's latent-norm pass-through (`_PASS_THROUGH`) and what the export's runtime
    never reads (the model's `untrained_parameters`, name endings: a vllm export's attention biases)."""
    skipped = tuple(getattr(model, "untrained_parameters", ()))
    found = {
        name: p
        for name, p in model.named_parameters()
        if ".self_attn." in name and not any(part in name for part in _PASS_THROUGH) and not name.endswith(skipped)
    }
    if not found:
        raise ConvertError("the model has no `.self_attn.` parameters to heal; pass a converted MLA model")
    return found


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student), computed in float32 (logits (B, L, V))."""
    log_student = torch.log_softmax(student_logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (log_teacher.exp() * (log_teacher - log_student)).sum(-1).mean()


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


def windows_of(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Non-overlapping windows (1, ≤window) of `ids` (1, N); a last window of one token is dropped."""
    return [ids[:, s : s + window] for s in range(0, ids.shape[-1], window) if ids[:, s : s + window].shape[-1] > 1]


@torch.no_grad()
def held_out_kl(original, model, ids: torch.Tensor, window: int) -> float:
    """KL(original ‖ model) per token on `ids` (1, N), in windows of `window` tokens (eval mode)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in windows_of(ids, window):  # (1, ≤window)
        n = chunk.shape[-1]
        total += float(distillation_loss(model(chunk).logits, original(chunk).logits)) * n
        count += n
    model.train(was_training)
    return total / count


def _measure(original, model, ids: torch.Tensor, window: int) -> dict:
    was_training = model.training
    model.eval()
    figures = compare_models(original, model, ids, window=window)
    model.train(was_training)
    keys = ("ppl_original", "ppl_converted", "ppl_ratio", "kl_mean", "top1_agreement")
    return {key: figures[key] for key in keys}


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
    accelerator = make_accelerator(opts, state_dir)
    device = accelerator.device
    windows, check_ids, train_tokens = _training_windows(train, opts)
    eval_ids = eval_ids.to(device)
    check_ids = None if check_ids is None else check_ids.to(device)
    original.to(device).requires_grad_(False).eval()
    model.to(device)
    trainable = trainable_parameters(model)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    base_rates = relative_rates(trainable.values(), opts.lr)
    if opts.gradient_checkpointing:
        _checkpointing(model, True)
    groups = [{"params": [p], "lr": rate} for p, rate in zip(trainable.values(), base_rates)]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    live = accelerator.unwrap_model(prepared)
    trainable = {name: p for name, p in live.named_parameters() if name in trainable}
    before = _measure(original, live, eval_ids, opts.eval_window)
    track = None
    if check_ids is not None:
        track = Backtracking(trainable, optimizer, lambda: held_out_kl(original, live, check_ids, opts.window))
    run = TrainingState(world=accelerator.num_processes)
    if opts.resume:
        found = latest_checkpoint(state_dir)
        if found is None:
            raise ConvertError(f"--resume: no checkpoint in {state_dir}; run without --resume to start")
        run = load_checkpoint(found, accelerator, trainable, optimizer, track, _signature(opts, accelerator))
    global_batch = opts.batch_size * opts.grad_accum * accelerator.num_processes
    window_tokens = opts.batch_size * opts.grad_accum * windows.window  # per process and step
    if state_dir is not None and accelerator.log_with:
        accelerator.init_trackers("convert-heal", config=_flat(opts))
    start, seconds_before = time.perf_counter(), run.seconds
    prepared.train()
    try:
        bar = progress(
            range(run.step, opts.steps),
            "healing",
            "step",
            opts.progress and accelerator.is_main_process,
            total=opts.steps - run.step,
        )
        for step in bar:
            batch = windows.batch(
                rank_samples(step, global_batch, accelerator.process_index, accelerator.num_processes)
            )
            loss = _train_step(accelerator, prepared, original, batch.to(device), opts)  # batch (B·A, window)
            accelerator.clip_grad_norm_(list(trainable.values()), 1.0)
            factor = (track.scale if track else 1.0) * warmup_cosine(step, opts.steps)
            for group, rate in zip(optimizer.param_groups, base_rates):
                group["lr"] = rate * factor
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
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
                save_checkpoint(state_dir, accelerator, run, trainable, optimizer, track, _signature(opts, accelerator))
        run.step, run.seconds = opts.steps, seconds_before + time.perf_counter() - start
    finally:
        if opts.gradient_checkpointing:
            _checkpointing(live, False)
        for name, p in live.named_parameters():
            p.requires_grad_(flags.get(name, p.requires_grad))
        live.eval()
    after = _measure(original, live, eval_ids, opts.eval_window)
    if accelerator.log_with:
        accelerator.log({"held_out/ppl_ratio": after["ppl_ratio"], "held_out/kl": after["kl_mean"]}, step=opts.steps)
        accelerator.end_training()
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
        "train_tokens": train_tokens,
        "tokens_trained": opts.steps * global_batch * windows.window,
        "eval_tokens": int(eval_ids.shape[-1]),
        "trained_parameters": sum(p.numel() for p in trainable.values()),
        "train_kl_first": run.history[0]["kl"] if run.history else None,
        "train_kl_last": run.history[-1]["kl"] if run.history else None,
        "history": run.history,
        "checks": track.report(int(check_ids.shape[-1])) if track else None,
        "seconds": run.seconds,
        "tokens_per_second": opts.steps * global_batch * windows.window / run.seconds if run.seconds else None,
        "device": str(device),
        "peak_device_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "before": before,
        "after": after,
    }, accelerator


def _train_step(accelerator, model, original, batch: torch.Tensor, opts: HealOptions) -> torch.Tensor:
    """Forward and backward of this process's share of a step, `opts.grad_accum` micro-batches of
    `opts.batch_size` windows (gradients synchronised on the last): the mean KL it trained on."""
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
    if isinstance(train, WindowsStreamed):
        check = train.held_out_ids() if opts.check_every else None
        return train, check, None
    ids = train.reshape(1, -1)  # (1, N)
    check = None
    if opts.check_every:
        ids, check = hold_out(ids, 16, "check tokens", "pass --check-every 0")
    return WindowsInMemory(ids, opts.window, opts.seed), check, int(ids.shape[-1])


def hold_out(ids: torch.Tensor, part: int, what: str, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` (1, N) split into its first tokens and its last 1/`part`, `what` (at least 2 tokens each)."""
    n_out = max(2, ids.shape[-1] // part)
    if ids.shape[-1] - n_out < 2:
        raise ConvertError(f"--text is too short to hold out {what}: give a longer text or {fix}")
    return ids[:, :-n_out], ids[:, -n_out:]


def _signature(opts: HealOptions, accelerator) -> dict:
    """What a checkpoint must share with the run that resumes it to continue the same run."""
    keys = ("steps", "lr", "window", "tokens", "check_every", "seed", "batch_size", "grad_accum")
    return {**{k: getattr(opts, k) for k in keys}, "processes": accelerator.num_processes}


def _flat(opts: HealOptions) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in asdict(opts).items()}


class Backtracking:
    """Keeps healing from moving a model away from the original: a held-out KL (`measure`) is
    checked every few steps; a better one keeps a copy of the trained tensors, a worse one puts
    the best copy back, clears AdamW's moments and halves the rate (`scale`). One rate does
    not suit every gap: a relative 1e-3 heals SmolLM2 at 25% of the cache but overshoots at
    75%, where the checks bring the held-out KL back down (docs/compression.md, "Healing")."""

    def __init__(self, trainable: dict[str, torch.nn.Parameter], optimizer, measure) -> None:
        self.trainable, self.optimizer, self.measure = trainable, optimizer, measure
        self.scale, self.halvings = 1.0, 0
        self.best_kl = measure()
        self.best_step = 0
        self.history = [{"step": 0, "kl": self.best_kl, "scale": 1.0}]
        self._best = self._copy()

    def _copy(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.trainable.items()}

    def check(self, step: int) -> None:
        """Measure at `step`: keep the weights if better, else go back to the best at half the rate."""
        kl = self.measure()
        self.history.append({"step": step, "kl": kl, "scale": self.scale})
        if kl < self.best_kl:
            self.best_kl, self.best_step, self._best = kl, step, self._copy()
            return
        self.restore_best()
        self.optimizer.state.clear()
        self.scale /= 2
        self.halvings += 1

    @torch.no_grad()
    def restore_best(self) -> None:
        """Put the best weights measured back into the model."""
        for name, p in self.trainable.items():
            p.copy_(self._best[name])

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the checks: the best weights and the figures."""
        keep = ("scale", "halvings", "best_kl", "best_step", "history")
        return {"best": self._best, **{k: getattr(self, k) for k in keep}}

    def load_state_dict(self, state: dict) -> None:
        self._best = {name: t.to(self.trainable[name].device) for name, t in state["best"].items()}
        for key in ("scale", "halvings", "best_kl", "best_step", "history"):
            setattr(self, key, state[key])

    def report(self, tokens: int) -> dict:
        """The checks for the healing report."""
        return {
            "tokens": tokens,
            "best_step": self.best_step,
            "best_kl": self.best_kl,
            "halvings": self.halvings,
            "history": self.history,
        }
