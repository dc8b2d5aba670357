"""The options of healing (`HealOptions`, with its sizes by device) and of `convert eval` (`EvalOptions`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from convert.errors import ConvertError
from convert.options.fields import (
    DEVICES,
    DTYPES,
    MIXED_PRECISIONS,
    TRACKERS,
    FromKwargs,
    choice,
    option,
    resolve_device,
)

if TYPE_CHECKING:
    import torch


@dataclass
class HealOptions(FromKwargs):
    """How `heal` trains: KL distillation of the MLA projections toward the original model.
    Every field is a flag of `convert heal` and a keyword of `convert.heal`."""

    force: bool = option(
        False, "Replace the output directory if it exists (only one that convert wrote).", group="output"
    )
    steps: int | None = option(
        None,
        "Optimizer steps (each on one global batch of windows: see --batch-size). Default: sized by the "
        "device (CPU 1,000, CUDA 2,000).",
        group="training",
        kind=int,
    )
    lr: float = option(
        1e-3,
        "AdamW learning rate of the MLA projections, relative: each tensor's is this times its RMS "
        "(warmed up over 10 steps, then a cosine to 0).",
        group="training",
    )
    window: int | None = option(
        None,
        "Tokens per training window. Default: sized by the device (CPU 256, CUDA 1,024).",
        group="training",
        kind=int,
    )
    eval_window: int = option(1024, "Tokens per window of the before/after perplexity.", group="training")
    tokens: int | None = option(
        None,
        "Tokens of --text to use (the last eighth is held out unless --eval-text; of the rest, the last "
        "sixteenth, at most 32,768, is kept for --check-every). Default: sized by the device (CPU 256,000, "
        "CUDA 4,194,304).",
        group="training",
        kind=int,
    )
    check_every: int | None = option(
        None,
        "Every N steps, measure the KL on a slice of --text held out from training (its last sixteenth): "
        "keep the best weights, and when the KL got worse go back to them at half the rate. 0: no checks. "
        "Default: sized by the device (CPU 125, CUDA 250: eight checks in a run of the default steps).",
        group="training",
        kind=int,
    )
    seed: int = option(0, "Seed of the window order.", group="training")
    batch_size: int | None = option(
        None,
        "Windows per micro-batch, per process (a step trains on batch size x grad accum x processes). "
        "Default: sized by the device (CPU 1, CUDA 8).",
        group="training",
        kind=int,
    )
    grad_accum: int = option(1, "Micro-batches accumulated per optimizer step, per process.", group="training")
    text_field: str = option("text", "The text's field in --text JSONL / Parquet rows.", group="training")
    streaming: bool = option(
        False,
        "Read --text as a stream, epoch after epoch (corpora larger than memory): needs --eval-text; the "
        "check tokens are the stream's first --tokens/16 (at most 32,768).",
        group="training",
    )
    save_every: int = option(
        0, "Write a checkpoint every N steps to the training directory (0: none); see --resume.", group="training"
    )
    resume: bool = option(
        False, "Continue from the latest checkpoint in the training directory (same options).", group="training"
    )
    device: str = option(
        "auto", "Where to train: auto = CUDA when present, else CPU.", group="advanced", choices=DEVICES
    )
    mixed_precision: str = option(
        "auto", "auto = bf16 on CUDA, no (float32) on CPU.", group="advanced", choices=MIXED_PRECISIONS
    )
    gradient_checkpointing: bool = option(
        False, "Recompute activations in the backward pass: less memory, more time.", group="advanced"
    )
    log_with: str = option(
        "auto",
        "Metrics tracker (in the training directory): auto = TensorBoard when installed; also in healing.json.",
        group="advanced",
        choices=TRACKERS,
    )
    max_shard_size: int | str = option(
        "5GB", "Start a new safetensors shard above this many bytes.", group="advanced", kind=str
    )
    progress: bool = option(
        True, "No progress bar or summary.", group="advanced", flag="--quiet", short="-q", off_flag="--quiet"
    )

    def __post_init__(self) -> None:
        choice("--device", self.device, DEVICES)
        if self.device == "cuda":
            resolve_device(self.device)
        if self.steps is not None and self.steps < 1:
            raise ConvertError(f"--steps {self.steps} must be at least 1")
        if not self.lr > 0:
            raise ConvertError(f"--lr {self.lr} must be a positive learning rate (e.g. 1e-3)")
        if (self.window is not None and self.window < 2) or self.eval_window < 2:
            raise ConvertError(f"--window {self.window} / --eval-window {self.eval_window}: at least 2 tokens each")
        if self.tokens is not None and self.tokens < 4:
            raise ConvertError(f"--tokens {self.tokens} must be at least 4")
        if self.check_every is not None and self.check_every < 0:
            raise ConvertError(f"--check-every {self.check_every} must be 0 (no checks) or a number of steps")
        choice("--mixed-precision", self.mixed_precision, MIXED_PRECISIONS)
        choice("--log-with", self.log_with, TRACKERS)
        for flag, value in (("--batch-size", self.batch_size), ("--grad-accum", self.grad_accum)):
            if value is not None and value < 1:
                raise ConvertError(f"{flag} {value} must be at least 1")
        if self.save_every < 0:
            raise ConvertError(f"--save-every {self.save_every} must be 0 (no checkpoints) or a number of steps")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def sized(self) -> HealOptions:
        """These options with every size left unset (None) taken from `HEAL_SIZES` for the device."""
        sizes: dict[str, Any] = heal_sizes(self.torch_device)  # Any: mypy checks **sizes against every field
        return replace(self, **{k: v for k, v in sizes.items() if getattr(self, k) is None})


#: Healing's sizes by device, for the options left unset: what takes SmolLM2 at 25% of the cache to
#: x1.10 its perplexity on two CPU cores (about an hour; measured: docs/healing.md), and a GPU's
#: (8,192 tokens a step; docs/healing.md, "Sized by the device"). The CPU reads as many tokens as its
#: steps train, so each window is trained about once. Either checks eight times in a run of its steps:
#: a check reads a sixteenth of what is read, so checking every 25 CPU steps would cost more than training.
HEAL_SIZES = {
    "cpu": {"steps": 1000, "window": 256, "tokens": 256000, "batch_size": 1, "check_every": 125},
    "cuda": {"steps": 2000, "window": 1024, "tokens": 1 << 22, "batch_size": 8, "check_every": 250},
}


def heal_sizes(device: torch.device) -> dict[str, int]:
    """`HEAL_SIZES` for `device`: CUDA's on a CUDA device, the CPU's anywhere else."""
    return HEAL_SIZES["cuda" if device.type == "cuda" else "cpu"]


#: The local lm_eval tasks shipped in convert/eval_tasks/ (`convert.lm_tasks.LOCAL_TASKS`).
EVAL_TASKS = "convert_ppl,convert_mc"


@dataclass
class EvalOptions(FromKwargs):
    """How `convert eval` runs lm-evaluation-harness. Every field is a flag of `convert eval` and a
    keyword of `convert.evaluate.evaluate`."""

    tasks: str = option(
        EVAL_TASKS,
        "lm_eval tasks, comma-separated: the local ones (no download), or any of lm_eval's own.",
        group="output",
    )
    limit: int | None = option(None, "Documents per task (default: all).", group="output", kind=int)
    batch_size: int = option(1, "lm_eval's batch size.", group="advanced")
    device: str = option(
        "auto", "Where the models run: auto = CUDA when present, else CPU.", group="advanced", choices=DEVICES
    )
    dtype: str = option("float32", "Precision of the runs.", group="advanced", choices=DTYPES)
    max_length: int | None = option(
        None,
        "lm_eval's context, the longest window of a rolling perplexity (default: the original's "
        "max_position_embeddings).",
        group="advanced",
        kind=int,
        cli=False,
    )

    def __post_init__(self) -> None:
        choice("--device", self.device, DEVICES)
        choice("--dtype", self.dtype, DTYPES)
        if not self.task_names:
            raise ConvertError(f"--tasks {self.tasks!r}: no task given; pass e.g. --tasks {EVAL_TASKS}")
        if self.limit is not None and self.limit < 1:
            raise ConvertError(f"--limit {self.limit} must be at least 1 (documents per task)")
        if self.batch_size < 1:
            raise ConvertError(f"--batch-size {self.batch_size} must be at least 1")
        if self.max_length is not None and self.max_length < 2:
            raise ConvertError(f"max_length {self.max_length} must be at least 2 tokens")

    @property
    def task_names(self) -> list[str]:
        return [task.strip() for task in self.tasks.split(",") if task.strip()]
