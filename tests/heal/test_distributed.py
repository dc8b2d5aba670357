"""Healing on accelerate: 2 processes (gloo, on CPU) train as 1 process with the same global batch;
a run killed after a checkpoint and resumed ends where an uninterrupted run ends; FSDP on GPUs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import convert

from conftest import TINY_LLAMA

pytestmark = pytest.mark.slow

#: One healing run's options: short, checked (the checks must agree across processes too).
RUN = "--steps 6 --window 32 --check-every 3 --log-with none --device cpu -q".split()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny Llama fixture, compressed to half its cache, and two texts."""
    root = tmp_path_factory.mktemp("dist")
    src = root / "src"
    shutil.copytree(TINY_LLAMA, src)
    convert.gqa2mla(src, root / "src-mla", kv_cache_ratio=0.5, method="svd", verify=False, progress=False)
    (root / "train.txt").write_text("It is a truth universally acknowledged, that a single man in possession. " * 40)
    (root / "held.txt").write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 8)
    return root


def _heal_args(root: Path, output: Path, *extra) -> list[str]:
    args = ["heal", root / "src-mla", "--original", root / "src", "--text", root / "train.txt"]
    return [str(a) for a in [*args, "--eval-text", root / "held.txt", "-o", output, *extra]]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _launch(command: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _killed_after_a_checkpoint(command: list[str], checkpoints: Path) -> Path:
    """Run `command`, SIGKILL it as soon as a checkpoint is in `checkpoints`; that directory."""
    process = subprocess.Popen(command, env=_env(), stderr=subprocess.DEVNULL)
    while process.poll() is None and not any(checkpoints.glob("step-*")):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed: give it more steps"
    return checkpoints


def _outcome(directory: Path) -> tuple[dict, dict]:
    return json.loads((directory / "healing.json").read_text()), load_file(directory / "model.safetensors")


#: The launchers users run: torchrun, and accelerate's (whose --cpu starts one process: on CPUs its
#: multi-process launcher is --multi_gpu, which starts torchrun's processes; they train on gloo).
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "accelerate": [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
    ],
}  # fmt: skip


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_train_as_one_with_the_same_global_batch(converted, tmp_path, launcher):
    """1 process accumulating 2 micro-batches and 2 processes of 1 each see the same windows per
    step: the same losses and checks to round-off, the same final weights within 1e-6."""
    _launch([sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "one", *RUN, "--grad-accum", "2")])
    _launch([*LAUNCHERS[launcher], "-m", "convert", *_heal_args(converted, tmp_path / "two", *RUN)])
    (one, w_one), (two, w_two) = _outcome(tmp_path / "one"), _outcome(tmp_path / "two")
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["global_batch_windows"] == two["global_batch_windows"] == 2
    assert two["distributed"] == "MULTI_CPU"
    assert [h["kl"] for h in two["history"]] == pytest.approx([h["kl"] for h in one["history"]], rel=1e-6)
    assert [c["kl"] for c in two["checks"]["history"]] == pytest.approx(
        [c["kl"] for c in one["checks"]["history"]], rel=1e-6
    )
    assert one["after"]["kl_mean"] < one["before"]["kl_mean"]  # it trained: the comparison means something
    assert w_one.keys() == w_two.keys()
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], rtol=0, atol=1e-6, msg=name)
    assert not (tmp_path / "two-training").exists()  # no checkpoints asked for, none left


def test_a_killed_run_resumed_ends_where_an_uninterrupted_run_ends(converted, tmp_path):
    """A run SIGKILLed once its first checkpoint is on disk, then `--resume`d, writes the same
    weights and the same per-step losses as a run never interrupted (bit for bit on one machine)."""
    run = [*RUN, "--steps", "30", "--check-every", "5", "--save-every", "3"]
    _launch([sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "full", *run)])
    command = [sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "part", *run)]
    checkpoints = _killed_after_a_checkpoint(command, tmp_path / "part-training" / "checkpoints")
    assert not (tmp_path / "part").exists() and any(checkpoints.glob("step-*"))
    refused = subprocess.run(command, capture_output=True, text=True, env=_env())
    assert refused.returncode == 2 and "--resume" in refused.stderr  # checkpoints are not silently reused
    _launch([*command, "--resume"])
    (full, w_full), (part, w_part) = _outcome(tmp_path / "full"), _outcome(tmp_path / "part")
    assert [h["kl"] for h in part["history"]] == [h["kl"] for h in full["history"]]
    assert part["checks"]["history"] == full["checks"]["history"]
    assert all(torch.equal(w_part[name], w_full[name]) for name in w_full)
    assert not (tmp_path / "part-training").exists()  # a finished run removes its checkpoints


def test_resume_with_other_options_is_refused(converted, tmp_path):
    run = [*RUN, "--steps", "30", "--save-every", "2"]
    command = [sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "out", *run)]
    _killed_after_a_checkpoint(command, tmp_path / "out-training" / "checkpoints")
    other = subprocess.run([*command, "--resume", "--lr", "2e-3"], capture_output=True, text=True, env=_env())
    assert other.returncode == 2, other.stderr
    assert "made with other options (lr 0.001 -> 0.002)" in other.stderr
    fresh = subprocess.run(
        [sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "new", *RUN, "--resume")],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert fresh.returncode == 2 and "no checkpoints" in fresh.stderr


def test_a_training_directory_convert_did_not_write_is_refused(converted, tmp_path):
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)
    (tmp_path / "mine" / "checkpoints" / "notes.txt").write_text("keep me")
    args = _heal_args(converted, tmp_path / "out", *RUN, "--training-dir", tmp_path / "mine")
    result = subprocess.run([sys.executable, "-m", "convert", *args], capture_output=True, text=True, env=_env())
    assert result.returncode == 2 and "not written by convert heal" in result.stderr
    assert (tmp_path / "mine" / "checkpoints" / "notes.txt").read_text() == "keep me"


def test_fsdp_on_cpus_is_refused_not_run_unsharded(converted, tmp_path):
    """accelerate shards only on accelerators: an FSDP launch on CPUs would train unsharded without
    a word. It is refused (exit 3) with what to do."""
    env = {**_env(), "ACCELERATE_USE_FSDP": "true"}
    args = _heal_args(converted, tmp_path / "out", *RUN)
    result = subprocess.run([sys.executable, "-m", "convert", *args], capture_output=True, text=True, env=env)
    assert result.returncode == 3 and "FSDP" in result.stderr and "GPUs" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP under accelerate needs a GPU (CPU runs say so above)")
def test_fsdp_on_one_gpu_trains_as_the_unsharded_run(converted, tmp_path):
    """The FSDP path (accelerate's FSDP2, launched by torchrun) on one GPU: the same losses as the
    plain single-process run on that GPU, in float32."""
    gpu = [a if a != "cpu" else "cuda" for a in RUN] + ["--mixed-precision", "no"]
    _launch([sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "plain", *gpu)])
    env = {**_env(), "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command = [*torchrun, "-m", "convert", *_heal_args(converted, tmp_path / "fsdp", *gpu)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (plain, w_plain), (fsdp, w_fsdp) = _outcome(tmp_path / "plain"), _outcome(tmp_path / "fsdp")
    assert fsdp["distributed"] == "FSDP"
    assert [h["kl"] for h in fsdp["history"]] == pytest.approx([h["kl"] for h in plain["history"]], rel=1e-4)
    for name in w_plain:
        torch.testing.assert_close(w_fsdp[name], w_plain[name], rtol=1e-4, atol=1e-5, msg=name)


def test_metrics_go_to_tensorboard_and_the_report(converted, tmp_path):
    """With TensorBoard installed (the test extra), `--log-with auto` writes the per-step KL to the
    training directory's event files; healing.json has the same per-step history."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = [a for a in RUN if a not in ("--log-with", "none")]
    _launch([sys.executable, "-m", "convert", *_heal_args(converted, tmp_path / "out", *run)])
    events = list((tmp_path / "out-training").rglob("events.out.tfevents.*"))
    assert events, sorted(str(p) for p in tmp_path.rglob("*"))
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    logged = [event.value for event in accumulator.Scalars("train/kl")]
    report, _ = _outcome(tmp_path / "out")
    assert logged == pytest.approx([h["kl"] for h in report["history"]], rel=1e-6)
    assert [h["step"] for h in report["history"]] == list(range(1, 7))
