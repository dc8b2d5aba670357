#!/usr/bin/env python3
"""Load time and peak memory of a converted checkpoint against stock transformers loading the original.

Cases:
  smollm2   the cached SmolLM2-135M-Instruct (float32), converted once per layout (`verify=False`)
  llama8b   a synthetic checkpoint of Llama-3-8B's shape (bench/memory.py's `write_synthetic`:
            random bfloat16, one shard per layer), `--layers N` decoder layers (default 4)

Variants, each load in a fresh subprocess (the imports of torch, transformers and convert are
not timed): `original` = `AutoModelForCausalLM.from_pretrained(src)`; per layout, `mla` =
`convert.load_mla_model(out)` and `auto` = `AutoModelForCausalLM.from_pretrained(out)` (the
converted model type, registered by `import convert`), all in the checkpoint's dtype on the CPU.
Variants are interleaved (the order rotates from repeat to repeat); medians are quoted. The
files are read once before each load so every load finds them in the page cache.

Two states of that cache, each measured `--repeat` times: `as written` (right after converting:
the output's pages are the ones the writer left, and `copy_file_range` leaves the copied tensors in
small page-cache folios that a mapping faults in 2-3x slower than the large ones a read makes), then
`re-read` (every checkpoint dropped from the cache with POSIX_FADV_DONTNEED and read back, as a
stored checkpoint is when a user loads it). The goals are judged on `re-read`.

Times: `load` = the call; `+touch` = the call and then one byte of every page of every weight
read. On the CPU `from_pretrained` returns with the weights still in the file's private mapping,
read page by page at their first use, while `load_mla_model` has read them into memory its
model owns: only the second time compares like with like.
Peak memory: the child's VmHWM (/proc/self/status) after the touch; "load's own" is
VmHWM minus the RSS after the imports (torch, transformers and convert alone take ~0.3 GiB).
Goals: converted / original time to weights in memory (`+touch`) ≤ 1.5×; the load's own peak ≤ 1.2× the
checkpoint's size.

    python bench/load.py [--repeat 3] [--cases smollm2,llama8b] [--layers 4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

GiB = 2**30
TIME_GOAL, MEMORY_GOAL = 1.5, 1.2
STATES = ("as written", "re-read")
MEASURES = ("load_s", "ready_s", "peak_rss_loaded", "peak_rss", "own_peak_rss", "rss_after_imports")

CHILD = r"""
import json, sys, time
def status():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}
mode, path, dtype = sys.argv[1:4]
import torch, transformers, convert
dtype = getattr(torch, dtype)
before = status()
t0 = time.perf_counter()
if mode == "mla":
    model = convert.load_mla_model(path, dtype=dtype)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
load_s = time.perf_counter() - t0
loaded = status()
params = {id(p): p for p in model.parameters()}.values()
with torch.no_grad():  # one byte of every page of every weight: mapped pages are read in
    touched = sum(int(p.detach().reshape(-1).view(torch.uint8)[::4096].sum()) for p in params)
ready_s = time.perf_counter() - t0
ready = status()
print(json.dumps({
    "load_s": load_s, "ready_s": ready_s, "rss_after_imports": before["VmRSS"],
    "peak_rss_loaded": loaded["VmHWM"], "peak_rss": ready["VmHWM"], "own_peak_rss": ready["VmHWM"] - before["VmRSS"],
    "class": type(model).__name__, "param_bytes": sum(p.numel() * p.element_size() for p in params),
}))
"""


def run_child(mode: str, path: Path, dtype: str) -> dict:
    """One load in a fresh process: its time and memory (see CHILD)."""
    env = {**os.environ, "PYTHONPATH": str(C.REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path), dtype], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"loading {path} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(directory))


def warm(directory: Path, chunk: int = 64 << 20) -> None:
    """Read the weight files once (into one reused buffer): the load finds them in the page cache."""
    buffer = bytearray(chunk)
    for path in weight_files(directory):
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def drop_from_page_cache(directory: Path) -> None:
    """Evict the weight files' clean pages (the writer fsyncs before it renames): the next read comes from disk."""
    for path in weight_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def case(name: str, src: Path, work: Path, layouts: list[str], dtype: str, repeat: int) -> dict:
    """Convert `src` once per layout, then time every variant's load `repeat` times, interleaved."""
    import convert

    variants = {"original": ("original", src)}
    converted_s = {}
    for layout in layouts:
        out = work / f"{name}-{layout}"
        t0 = time.perf_counter()
        convert.gqa2mla(src, out, layout=layout, verify=False, progress=False, force=True)
        converted_s[layout] = time.perf_counter() - t0
        print(f"{name}: converted ({layout}) in {converted_s[layout]:.1f} s", flush=True)
        variants[f"mla:{layout}"] = ("mla", out)
        variants[f"auto:{layout}"] = ("auto", out)

    result = {"source": str(src), "dtype": dtype, "convert_s": converted_s}
    for state in STATES:
        if state == "re-read":
            for _, path in variants.values():
                drop_from_page_cache(path)
        samples, contention = measure(f"{name} ({state})", variants, dtype, repeat)
        result[state] = {
            "samples": samples,
            "contention_per_repeat": contention,
            "summary": summarise(variants, samples),
        }
    result["summary"] = result["re-read"]["summary"]  # what the goals judge
    return result


def measure(name: str, variants: dict, dtype: str, repeat: int) -> tuple[dict, list]:
    """Every variant's load `repeat` times, interleaved, each in a fresh process."""
    samples = {key: [] for key in variants}
    contention = []
    for rep in range(repeat):
        watch = C.Contention()
        for key in C.rotate(list(variants), rep):
            mode, path = variants[key]
            warm(path)
            samples[key].append(run_child(mode, path, dtype))
        contention.append(watch.report())
        print(
            f"{name} repeat {rep + 1}/{repeat}: "
            + ", ".join(f"{k} {v[-1]['load_s']:.2f}/{v[-1]['ready_s']:.2f}s" for k, v in samples.items())
            + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
            flush=True,
        )
    return samples, contention


def summarise(variants: dict, samples: dict) -> dict:
    """Medians per variant, and each one's ratios to the original's."""
    summary = {}
    for key, (_, path) in variants.items():
        runs = samples[key]
        summary[key] = {
            "class": runs[-1]["class"],
            "checkpoint_bytes": checkpoint_bytes(path),
            "param_bytes": runs[-1]["param_bytes"],
            **{k: C.median([r[k] for r in runs]) for k in MEASURES},
        }
    original = summary["original"]
    for s in summary.values():
        s["own_peak_over_checkpoint"] = s["own_peak_rss"] / s["checkpoint_bytes"]
        s["peak_over_checkpoint"] = s["peak_rss"] / s["checkpoint_bytes"]
        s["load_over_original"] = s["load_s"] / original["load_s"]
        s["ready_over_original"] = s["ready_s"] / original["ready_s"]
        s["meets_goals"] = s["ready_over_original"] <= TIME_GOAL and s["own_peak_over_checkpoint"] <= MEMORY_GOAL
    return summary


HEADERS = [
    "case",
    "page cache",
    "load",
    "load s",
    "+touch s",
    "load × orig",
    "+touch × orig",
    "ckpt GiB",
    "peak RSS GiB",
]
HEADERS += ["load's own GiB", "own / ckpt", "goals"]


def rows(name: str, result: dict) -> list[list]:
    return [
        [name, state, key, s["load_s"], s["ready_s"], s["load_over_original"], s["ready_over_original"]]
        + [s["checkpoint_bytes"] / GiB, s["peak_rss"] / GiB, s["own_peak_rss"] / GiB, s["own_peak_over_checkpoint"]]
        + [("yes" if s["meets_goals"] else "no") if state == "re-read" else "(not judged)"]
        for state in STATES
        for key, s in result[state]["summary"].items()
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "load", repeat=3)
    parser.add_argument("--cases", default="smollm2,llama8b", help="comma-separated: smollm2, llama8b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the synthetic 8B-shape checkpoint")
    parser.add_argument("--layouts", nargs="+", default=["absorbed", "factored"], choices=["absorbed", "factored"])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory for checkpoints (default: $TMPDIR)"
    )
    args = parser.parse_args(argv)
    cases = args.cases.split(",")

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    result = C.header("load", "cpu", quiet)
    result["repeat"] = args.repeat
    result["goals"] = {"ready_over_original": TIME_GOAL, "own_peak_over_checkpoint": MEMORY_GOAL}
    table = []
    work = Path(tempfile.mkdtemp(prefix="convert-bench-load-", dir=args.workdir))
    try:
        if "smollm2" in cases:
            result["smollm2"] = case("smollm2", C.smollm2_dir(), work, args.layouts, "float32", args.repeat)
            table += rows("smollm2", result["smollm2"])
        if "llama8b" in cases:
            import memory

            src = work / "llama3-8b-shape"
            t0 = time.perf_counter()
            memory.write_synthetic(src, args.layers)
            print(f"wrote the synthetic checkpoint ({args.layers} layers) in {time.perf_counter() - t0:.0f} s")
            name = f"llama8b[{args.layers} layers]"
            result["llama8b"] = case("llama8b", src, work, args.layouts, "bfloat16", args.repeat)
            result["llama8b"]["layers"] = args.layers
            table += rows(name, result["llama8b"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["contention"] = whole_run.report()

    print()
    print(C.table(HEADERS, table))
    print(
        f"\ngoals: converted / original time to weights in memory (+touch) ≤ {TIME_GOAL}× "
        f"(from_pretrained returns with the weights mapped, read at first use), the load's own peak RSS ≤ {MEMORY_GOAL}× the checkpoint (peak RSS "
        "minus the RSS after importing torch, transformers and convert)"
    )
    print(C.contention_line(result["contention"]))
    C.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
