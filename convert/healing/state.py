"""Healing checkpoints: every `--save-every` steps the trained tensors, AdamW's state, the checks'
best weights, the step (which fixes the data position and the learning rate) and the random
states, written to `<training dir>/checkpoints/step-N` atomically (a temporary directory renamed
once every process wrote its part); `--resume` continues from the latest to the same result as an
uninterrupted run. One file per process under FSDP (each holds its shards), else one."""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from convert.errors import ConvertError

#: Marks a directory of checkpoints as convert's: only such a directory's contents are ever removed.
MARKER = ".convert-heal-checkpoints"
#: Checkpoints kept: the latest ones (a crash while writing one leaves the one before).
KEEP = 2


@dataclass
class TrainingState:
    """Where a run is: the next step, the seconds trained, the per-step figures."""

    world: int = 1
    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)

    def record(self, step: int, kl: float, lr_factor: float, seconds: float) -> None:
        """Step `step` (from 0) ended with mean KL `kl`, `seconds` into the run."""
        self.history.append({"step": step + 1, "kl": kl, "lr_factor": lr_factor, "seconds": seconds})


def checkpoint_root(state_dir: Path) -> Path:
    return Path(state_dir) / "checkpoints"


def claim(state_dir: Path, resume: bool, force: bool, remove: bool = True) -> None:
    """Check the training directory before a run: a checkpoint directory that is not convert's is
    refused; one with checkpoints needs --resume (continue) or --force (start over, their removal
    left to the main process: `remove`)."""
    root = checkpoint_root(state_dir)
    if not root.exists():
        if resume:
            raise ConvertError(f"--resume: no checkpoints in {state_dir}; run without --resume to start")
        return
    if not (root / MARKER).is_file():
        raise ConvertError(f"{root} exists and was not written by convert heal; choose another --training-dir")
    found = _checkpoints(root)
    if found and not (resume or force):
        raise ConvertError(
            f"{state_dir} holds checkpoints of an earlier run (step {found[-1][0]}); pass --resume to continue "
            "it or --force to start over"
        )
    if force and not resume and remove:
        remove_checkpoints(state_dir)


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = []
    for path in root.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def latest_checkpoint(state_dir: Path | None) -> Path | None:
    """The latest complete checkpoint of a training directory, or None."""
    if state_dir is None or not (checkpoint_root(state_dir) / MARKER).is_file():
        return None
    found = _checkpoints(checkpoint_root(state_dir))
    return found[-1][1] if found else None


def remove_checkpoints(state_dir: Path, finished: bool = False) -> None:
    """Remove the checkpoints (and temporaries) convert wrote in a training directory; once the
    run is `finished`, the checkpoint directory too, and the training directory if that leaves it
    empty (tracker logs stay)."""
    root = checkpoint_root(state_dir)
    if not (root / MARKER).is_file():
        return
    for path in root.iterdir():
        if path.is_dir() and (path.name.startswith("step-") or path.name.startswith(".step-")):
            shutil.rmtree(path)
    if finished:
        (root / MARKER).unlink()
        for directory in (root, Path(state_dir)):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A process's own part of a tensor: its shard of an FSDP DTensor, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _rank_file(directory: Path, accelerator) -> Path:
    sharded = str(accelerator.distributed_type).endswith("FSDP")
    return directory / f"rank-{accelerator.process_index if sharded else 0}.pt"


def save_checkpoint(state_dir: Path, accelerator, run: TrainingState, trainable, optimizer, checks, signature) -> Path:
    """Write checkpoint `step-<run.step>` atomically (all processes call it)."""
    root = checkpoint_root(state_dir)
    temporary, final = root / f".step-{run.step:08d}.tmp", root / f"step-{run.step:08d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text("checkpoints written by `convert heal`; removed when the run ends\n")
        if temporary.exists():
            shutil.rmtree(temporary)  # a run killed while writing this step
        temporary.mkdir()
    accelerator.wait_for_everyone()
    path = _rank_file(temporary, accelerator)
    if accelerator.process_index == 0 or path.name != "rank-0.pt":
        state = {
            "signature": signature,
            "run": asdict(run),
            "trainable": {name: _local(p.detach()).cpu().clone() for name, p in trainable.items()},
            "optimizer": optimizer.state_dict(),
            "checks": None if checks is None else checks.state_dict(),
            "random": _random_states(),
        }
        torch.save(state, path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(temporary, final)
        for _, old in _checkpoints(root)[:-KEEP]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(path: Path, accelerator, trainable, optimizer, checks, signature) -> TrainingState:
    """Put a checkpoint's state back; refused when it was made by a run with other options."""
    file = _rank_file(path, accelerator)
    state = torch.load(file, map_location="cpu", weights_only=False)
    if state["signature"] != signature:
        changed = ", ".join(
            f"{key} {state['signature'].get(key)} -> {value}"
            for key, value in signature.items()
            if state["signature"].get(key) != value
        )
        raise ConvertError(f"--resume {path}: made with other options ({changed}); resume with the same options")
    with torch.no_grad():
        for name, p in trainable.items():
            _local(p).copy_(state["trainable"][name])
    optimizer.load_state_dict(state["optimizer"])
    if checks is not None and state["checks"] is not None:
        checks.load_state_dict(state["checks"])
    _set_random_states(state["random"])
    return TrainingState(**state["run"])


def _random_states() -> dict:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_random_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
