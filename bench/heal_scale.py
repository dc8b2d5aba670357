#!/usr/bin/env python3
"""Healing at scale: `convert heal` run as users run it (a command, one process or several under
torchrun), timed.

  --processes 1,2   SmolLM2-135M, factored at 25% of the KV cache (Fisher-calibrated on *Pride and
                    Prejudice*), healed on further tokens of that novel and evaluated on *Emma*, by
                    1 process and by 2 (data parallel, gloo on CPU) for the same wall time: each
                    configuration's step time is probed first (3 steps), then it trains for as many
                    steps as fit `--minutes`. Tokens per second, perplexity ratio before/after.
  --shape 8b        Llama-3-8B's shape with `--layers` decoder layers, random bfloat16 weights made
                    on the device, factored at 25% (plain SVD), healed for a few steps: the
                    median step time and peak GPU memory, unsharded and under accelerate's FSDP
                    (torchrun, one process per GPU). On a GPU machine.

    python bench/heal_scale.py --processes 1,2 --minutes 5      # ~15 min on 2 cores
    python bench/heal_scale.py --shape 8b --layers 4 --steps 8  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "fixtures"))

import _common  # noqa: E402


def _heal(converted: Path, original: Path, output: Path, processes: int, args: list[str], env=None) -> dict:
    """`convert heal` as a command (under torchrun for several processes): its healing.json."""
    launcher = [sys.executable, "-m", "convert"]
    if processes > 1 or (env or {}).get("ACCELERATE_USE_FSDP"):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
        launcher += ["-m", "convert"]
    command = [*launcher, "heal", str(converted), "--original", str(original), "-o", str(output), "--force", *args]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    report = json.loads((output / "healing.json").read_text())
    report["wall_s"] = time.perf_counter() - t0
    return report


def _step_seconds(report: dict, skip: int = 2) -> float:
    """Median seconds per step, the first `skip` steps (warm-up) left out."""
    times = [0.0] + [h["seconds"] for h in report["history"]]
    return statistics.median(b - a for a, b in list(zip(times, times[1:]))[skip:])


def processes_run(args) -> dict:
    """1 process vs N on SmolLM2 25% factored, for the same wall time each."""
    import realdata

    import convert

    src = realdata.smollm2_dir()
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    calib, heal_text, held = work / "calib.txt", work / "heal.txt", work / "emma.txt"
    book = realdata.austen_text("prideprejudice")
    calib.write_text(book[: len(book) // 4])
    heal_text.write_text(book[len(book) // 4 :])
    held.write_text(realdata.austen_text("emma")[:20000])  # ~4,600 tokens
    tiny = work / "emma-probe.txt"
    tiny.write_text(realdata.austen_text("emma")[:2000])  # the probes time steps, not the model
    converted = work / "factored-25"
    convert.gqa2mla(
        src, converted, layout="factored", kv_cache_ratio=0.25, method="fisher", calib=calib,
        calib_tokens=4096, verify=False, progress=False,
    )  # fmt: skip
    common = ["--text", str(heal_text), "--eval-text", str(held), "--tokens", str(args.tokens), "--window"]
    common += [str(args.window), "--check-every", "25", "--log-with", "none", "--device", "cpu", "-q"]
    rows = []
    for n in args.processes:
        accum = max(args.processes) // n  # the same global batch for every configuration
        options = [*common, "--grad-accum", str(accum)]
        probe_options = [*options, "--steps", "3", "--check-every", "0", "--eval-text", str(tiny)]
        probe = _heal(converted, src, work / f"probe-{n}", n, probe_options)
        step_s = _step_seconds(probe, skip=1)
        steps = max(10, int(args.minutes * 60 / step_s))
        report = _heal(converted, src, work / f"healed-{n}", n, [*options, "--steps", str(steps)])
        rows.append(
            {
                "processes": n,
                "grad_accum": accum,
                "global_batch_windows": report["global_batch_windows"],
                "steps": steps,
                "train_s": report["seconds"],
                "wall_s": report["wall_s"],
                "tokens_trained": report["tokens_trained"],
                "tokens_per_s": report["tokens_per_second"],
                "step_s": _step_seconds(report),
                "ppl_ratio_before": report["before"]["ppl_ratio"],
                "ppl_ratio_after": report["after"]["ppl_ratio"],
                "kl_before": report["before"]["kl_mean"],
                "kl_after": report["after"]["kl_mean"],
                "best_step": (report["checks"] or {}).get("best_step"),
            }
        )
        print(
            f"{n} process(es): {steps} steps in {report['seconds']:.0f} s, {rows[-1]['tokens_per_s']:.0f} tokens/s, "
            f"×{rows[-1]['ppl_ratio_before']:.3f} -> ×{rows[-1]['ppl_ratio_after']:.3f}",
            flush=True,
        )
    return {"model": "smollm2", "layout": "factored", "kv_cache_ratio": 0.25, "minutes": args.minutes, "rows": rows}


def shape_run(args) -> dict:
    """Llama-3-8B's shape, `args.layers` layers, on the GPU: step time and memory, plain and FSDP."""
    import memory
    import torch

    import convert

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    src = work / "llama-8b-shape"
    from gpu import SMALL

    memory.write_synthetic(src, args.layers, device=device, base=SMALL if args.small else memory.LLAMA3_8B)
    converted = work / "factored-25"
    convert.gqa2mla(
        src, converted, layout="factored", kv_cache_ratio=0.25, method="svd", verify=False, progress=False,
        device=str(device),
    )  # fmt: skip
    text = work / "text.txt"
    text.write_text((HERE.parent / "README.md").read_text() * 8)  # no tokenizer: UTF-8 bytes as tokens
    options = ["--text", str(text), "--steps", str(args.steps), "--window", str(args.window), "--check-every", "0"]
    options += ["--tokens", str(args.steps * args.window * 2), "--eval-window", "512", "--log-with", "none", "-q"]
    options += ["--batch-size", str(args.batch_size), "--gradient-checkpointing"]
    rows = []
    fsdp_env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
    runs = (("single", None), ("fsdp", fsdp_env)) if device.type == "cuda" else (("single", None),)  # FSDP: GPUs
    for name, env in runs:
        report = _heal(converted, src, work / f"healed-{name}", 1, options, env)
        rows.append(
            {
                "run": name,
                "distributed": report["distributed"],
                "mixed_precision": report["mixed_precision"],
                "step_s": _step_seconds(report),
                "tokens_per_s_step": args.batch_size * args.window / _step_seconds(report),
                "peak_gpu_gib": report.get("peak_device_gib"),
                "trained_parameters": report["trained_parameters"],
                "wall_s": report["wall_s"],
            }
        )
        print(f"{name}: {rows[-1]['step_s'] * 1000:.0f} ms/step, peak {rows[-1]['peak_gpu_gib']} GiB", flush=True)
    return {
        "shape": "small" if args.small else "llama3-8b",
        "layers": args.layers,
        "window": args.window,
        "batch": args.batch_size,
        "rows": rows,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--minutes", type=float, default=5.0, help="wall time of each configuration's training")
    p.add_argument("--shape", choices=["8b"], default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--small", action="store_true", help="--shape on a tiny Llama (a check of this script on CPU)")
    p.add_argument("--steps", type=int, default=8, help="--shape: steps timed")
    p.add_argument("--batch-size", type=int, default=1, help="--shape: windows per step")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--tokens", type=int, default=65536, help="--processes: tokens of the novel healed on")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if (args.processes is None) == (args.shape is None):
        p.error("give --processes or --shape")
    import torch

    device = "cuda" if args.shape and torch.cuda.is_available() else "cpu"
    result = _common.header("heal_scale", device, {"quiet": None}) | {"device": device}
    result |= processes_run(args) if args.processes else shape_run(args)
    out = args.out or _common.result_file("heal_scale", "heal_scale_gpu.json" if args.shape else "heal_scale.json")
    _common.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
