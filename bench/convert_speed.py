#!/usr/bin/env python3
"""Conversion wall time and peak memory against the I/O floor: SmolLM2-135M, or (`--llama8b N`)
a synthetic checkpoint of Llama-3-8B's shape with N decoder layers (random bfloat16, sharded).

Per repeat, interleaved (the order rotates from repeat to repeat):

  read              every tensor of the source with safetensors alone
                    (`safe_open` + `get_tensor`, then `.clone()`: safetensors
                    0.8 returns mmap-backed tensors, so the clone is what makes
                    the bytes really come off the page cache / disk)
  write[layout]     `save_file` of the conversion output's own tensors (the
                    same bytes and shards, loaded once into memory beforehand);
                    then an fsync of the files, timed separately
                    (`CheckpointWriter` fsyncs before its rename, `save_file`
                    does not)
  convert[layout]   `convert.gqa2mla(src, out, layout=..., verify=False,
                    progress=False, force=True)`, in this process (imports done)

floor = read + write (the brief's floor) and floor+fsync = read + write + fsync
(the same durability as the converter); the target is convert ≤ 2 × floor.
Before every timed step: the previous output is deleted and `os.sync()` is
called (both untimed), so no step pays for another's dirty pages.

Page cache: by default the source file is read once before timing, so it is
warm (the JSON records `fincore`'s resident share before each step); `--cold`
evicts it with posix_fadvise(DONTNEED) before each read/convert step instead.

Peak RSS: each of `--repeat` fresh subprocesses either only imports torch +
convert (the baseline) or imports and converts. The peak is the child's own
high-water mark: `VmHWM` of /proc/self/status at its end, cross-checked with
`/usr/bin/time -f %M` (GNU time's wait4 ru_maxrss) where that exists. Not the
parent's RUSAGE_CHILDREN or the child's RUSAGE_SELF ru_maxrss: on Linux those
carry over the RSS of the process that did the fork/exec (Python's subprocess
vforks from this big benchmark process), so every child would read ~2 GB. The
child also samples /proc/self/status every 2 ms for its peak anonymous and
file-backed (mmap'd checkpoint, page-cache) RSS. Target: conversion peak below
the checkpoint's size on disk.

    python bench/convert_speed.py [--repeat 5] [--cold] [--profile]
    python bench/convert_speed.py --llama8b 4    # -> bench/results/convert_speed/convert_speed_llama8b.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LAYOUTS = ("absorbed", "factored")
GNU_TIME = "/usr/bin/time"

CHILD = r"""
import json, os, resource, sys, threading, time
args = json.loads(sys.argv[1])
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in FIELDS:
                out[key] = int(line.split()[1])  # kB
    return out

peak = {k: 0 for k in FIELDS}
at_peak = {}
stop = threading.Event()

def sample():
    global at_peak
    while not stop.is_set():
        s = status()
        for k, v in s.items():
            peak[k] = max(peak[k], v)
        if s.get("VmRSS", 0) >= peak["VmRSS"]:
            at_peak = s
        time.sleep(0.002)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
import torch
import convert
after_import = status()
t1 = time.perf_counter()
if args["mode"] == "convert":
    convert.gqa2mla(args["src"], args["out"], layout=args["layout"], verify=False, progress=False, force=True)
t2 = time.perf_counter()
stop.set()
thread.join()
print("RESULT " + json.dumps({
    "vm_hwm_kib": status()["VmHWM"],
    "ru_maxrss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    "sampled_peak_kib": peak,
    "sampled_at_peak_kib": at_peak,
    "after_import_kib": after_import,
    "import_s": t1 - t0,
    "work_s": t2 - t1,
}))
"""


# ------------------------------------------------------------------ helpers


def resident_fraction(path: Path) -> float | None:
    """Share of `path` in the page cache (util-linux fincore), or None without it."""
    if shutil.which("fincore") is None:
        return None
    proc = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)], capture_output=True, text=True
    )
    try:
        res, size = (int(x) for x in proc.stdout.split())
        return res / size if size else None
    except ValueError:
        return None


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).clone()  # bring the bytes into private memory
                total += tensor.nbytes
                del tensor
    return total


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run_child(mode: str, src: Path, out: Path, layout: str) -> dict:
    args = json.dumps({"mode": mode, "src": str(src), "out": str(out), "layout": layout})
    cmd = [sys.executable, "-c", CHILD, args]
    if os.path.exists(GNU_TIME):
        cmd = [GNU_TIME, "-f", "GNU_TIME_MAXRSS_KIB %M", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} {layout} failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    timed = [ln for ln in proc.stderr.splitlines() if ln.startswith("GNU_TIME_MAXRSS_KIB ")]
    result["gnu_time_maxrss_kib"] = int(timed[-1].split()[1]) if timed else None
    remove(out)
    return result


def profile_conversion(src: Path, out: Path, layout: str, top: int = 25) -> dict:
    import convert

    remove(out)
    os.sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result = convert.gqa2mla(src, out, layout=layout, verify=False, progress=False, force=True)
    prof.disable()
    wall = time.perf_counter() - t0
    texts = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        texts[key] = buf.getvalue()
    remove(out)
    return {
        "layout": layout,
        "wall_s": wall,
        "timings": result.timings,
        "by_tottime": texts["tottime"],
        "by_cumulative": texts["cumulative"],
    }


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "convert_speed")
    parser.add_argument(
        "--src", type=Path, default=None, help="checkpoint directory (default: the cached SmolLM2-135M)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory for outputs (default: a new dir in $TMPDIR)"
    )
    parser.add_argument(
        "--cold", action="store_true", help="evict the source from the page cache before each read/convert step"
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile one absorbed and one factored conversion")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument(
        "--llama8b",
        type=int,
        default=None,
        metavar="N",
        help="time a synthetic Llama-3-8B-shape checkpoint with N decoder layers instead (written to the scratch dir)",
    )
    args = parser.parse_args(argv)
    if args.llama8b is not None and args.out == C.result_file("convert_speed"):
        args.out = C.result_file("convert_speed", "convert_speed_llama8b.json")

    import torch
    from safetensors.torch import load_file, save_file

    import convert

    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=args.workdir))
    if args.llama8b is not None:
        from memory import write_synthetic

        src, model = work / "llama3-8b-shape", f"Llama-3-8B shape, {args.llama8b} layers, bfloat16"
        write_synthetic(src, args.llama8b)
    else:
        src, model = args.src or C.smollm2_dir(), "SmolLM2-135M float32"
    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    src_files = shards(src)
    src_bytes = sum(f.stat().st_size for f in src_files)
    print(f"source {src} ({src_bytes / 1e6:.1f} MB), scratch {work}, cache {'cold' if args.cold else 'warm'}")

    try:
        # Warm-up (untimed): one conversion per layout gives the output tensors for the write floor.
        outputs = {}
        output_bytes = {}
        for layout in LAYOUTS:
            out = work / f"warm-{layout}"
            convert.gqa2mla(src, out, layout=layout, verify=False, progress=False, force=True)
            output_bytes[layout] = sum(f.stat().st_size for f in shards(out))
            outputs[layout] = {f.name: {k: v.clone() for k, v in load_file(f).items()} for f in shards(out)}
            remove(out)
        read_bytes = read_all(src_files)  # also warms the page cache

        steps = ["read"] + [f"write:{l}" for l in LAYOUTS] + [f"convert:{l}" for l in LAYOUTS]
        samples: dict[str, list] = {s: [] for s in steps}
        fsyncs: dict[str, list] = {l: [] for l in LAYOUTS}
        phases: dict[str, list] = {l: [] for l in LAYOUTS}
        resident: dict[str, list] = {s: [] for s in steps}
        contention = []
        for rep in range(args.repeat):
            watch = C.Contention()
            for step in C.rotate(steps, rep):
                kind, _, layout = step.partition(":")
                dest = work / f"{kind}-{layout or 'src'}"
                remove(dest)
                os.sync()
                if args.cold and kind in ("read", "convert"):
                    evict(src_files)
                resident[step].append(min(resident_fraction(f) or 0.0 for f in src_files))
                if kind == "read":
                    t0 = time.perf_counter()
                    read_all(src_files)
                    samples[step].append(time.perf_counter() - t0)
                elif kind == "write":
                    dest.mkdir()
                    t0 = time.perf_counter()
                    for name, tensors in outputs[layout].items():
                        save_file(tensors, str(dest / name), metadata={"format": "pt"})
                    t1 = time.perf_counter()
                    for name in outputs[layout]:
                        fsync_file(dest / name)
                    t2 = time.perf_counter()
                    samples[step].append(t1 - t0)
                    fsyncs[layout].append(t2 - t1)
                else:
                    t0 = time.perf_counter()
                    result = convert.gqa2mla(src, dest, layout=layout, verify=False, progress=False, force=True)
                    samples[step].append(time.perf_counter() - t0)
                    phases[layout].append(result.timings)
                remove(dest)
            contention.append(watch.report())
            print(
                f"repeat {rep + 1}/{args.repeat}: "
                + ", ".join(f"{s} {samples[s][-1]:.2f}s" for s in steps)
                + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
                flush=True,
            )

        med = {s: C.median(v) for s, v in samples.items()}
        rows, summary = [], {}
        for layout in LAYOUTS:
            conv = samples[f"convert:{layout}"]
            write = samples[f"write:{layout}"]
            floor = [r + w for r, w in zip(samples["read"], write)]
            floor_fsync = [f + s for f, s in zip(floor, fsyncs[layout])]
            summary[layout] = {
                "output_bytes": output_bytes[layout],
                "convert_s": med[f"convert:{layout}"],
                "read_s": med["read"],
                "write_s": med[f"write:{layout}"],
                "fsync_s": C.median(fsyncs[layout]),
                "floor_s": C.median(floor),
                "floor_fsync_s": C.median(floor_fsync),
                "ratio_to_floor": C.median([c / f for c, f in zip(conv, floor)]),
                "ratio_to_floor_fsync": C.median([c / f for c, f in zip(conv, floor_fsync)]),
                "phases_median": {k: C.median([p.get(k) for p in phases[layout]]) for k in phases[layout][0]},
            }
            s = summary[layout]
            rows.append(
                [
                    layout,
                    f"{output_bytes[layout] / 1e6:.0f}",
                    s["convert_s"],
                    s["read_s"],
                    s["write_s"],
                    s["fsync_s"],
                    s["floor_s"],
                    s["ratio_to_floor"],
                    s["floor_fsync_s"],
                    s["ratio_to_floor_fsync"],
                ]
            )

        print(
            f"\n### Conversion time vs I/O floor ({model}, {src_bytes / 1e6:.0f} MB; "
            f"source {'cold' if args.cold else 'warm'} in page cache; medians of {args.repeat})\n"
        )
        print(
            C.table(
                [
                    "layout",
                    "output MB",
                    "convert s",
                    "read s",
                    "write s",
                    "fsync s",
                    "floor s",
                    "convert / floor",
                    "floor+fsync s",
                    "convert / (floor+fsync)",
                ],
                rows,
            )
        )
        print("\n(ratios: median over repeats of the per-repeat ratio)")
        for layout in LAYOUTS:
            p = summary[layout]["phases_median"]
            print(f"{layout}: gqa2mla timings (median): " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))

        rss = None
        if not args.no_rss:
            rss = {"baseline": [], **{l: [] for l in LAYOUTS}}
            for rep in range(args.repeat):
                for what in C.rotate(["baseline", *LAYOUTS], rep):
                    os.sync()
                    if args.cold:
                        evict(src_files)
                    mode = "import" if what == "baseline" else "convert"
                    rss[what].append(
                        run_child(mode, src, work / f"rss-{what}", what if what in LAYOUTS else "absorbed")
                    )
            peak = {w: C.median([r["vm_hwm_kib"] for r in v]) * 1024 for w, v in rss.items()}
            gnu = {w: C.median([r["gnu_time_maxrss_kib"] for r in v]) for w, v in rss.items()}
            gnu = {w: None if v is None else v * 1024 for w, v in gnu.items()}
            anon = {w: C.median([r["sampled_peak_kib"]["RssAnon"] for r in v]) * 1024 for w, v in rss.items()}
            filep = {w: C.median([r["sampled_peak_kib"]["RssFile"] for r in v]) * 1024 for w, v in rss.items()}
            rows = []
            for w in ["baseline", *LAYOUTS]:
                above = peak[w] - peak["baseline"]
                rows.append(
                    [
                        w if w == "baseline" else f"convert {w}",
                        f"{peak[w] / 1e6:.0f}",
                        "–" if gnu[w] is None else f"{gnu[w] / 1e6:.0f}",
                        f"{above / 1e6:.0f}",
                        f"{anon[w] / 1e6:.0f}",
                        f"{filep[w] / 1e6:.0f}",
                        peak[w] / src_bytes,
                        above / src_bytes,
                    ]
                )
            print(
                f"\n### Peak RSS (fresh subprocess, medians of {args.repeat}; checkpoint {src_bytes / 1e6:.0f} MB on disk)\n"
            )
            print(
                C.table(
                    [
                        "process",
                        "peak RSS MB (VmHWM)",
                        "GNU time %M MB",
                        "above baseline MB",
                        "peak anon MB",
                        "peak file-backed MB",
                        "peak / checkpoint",
                        "(peak − baseline) / checkpoint",
                    ],
                    rows,
                )
            )
            summary["rss"] = {
                "checkpoint_bytes": src_bytes,
                "peak_bytes": peak,
                "gnu_time_peak_bytes": gnu,
                "peak_anon_bytes": anon,
                "peak_file_bytes": filep,
                "peak_over_checkpoint": {w: peak[w] / src_bytes for w in peak},
                "above_baseline_over_checkpoint": {w: (peak[w] - peak["baseline"]) / src_bytes for w in peak},
            }

        profile = None
        if args.profile:
            profile = [profile_conversion(src, work / f"profile-{l}", l) for l in LAYOUTS]
            for p in profile:
                print(f"\n### cProfile, {p['layout']} ({p['wall_s']:.2f} s under the profiler), by tottime\n")
                print("```\n" + "\n".join(p["by_tottime"].splitlines()[:40]) + "\n```")

        run = whole_run.report()
        print("\n" + C.contention_line(run))
        data = C.header("convert_speed", "cpu", quiet)
        data.update(
            {
                "source": str(src) if args.llama8b is None else model,
                "source_files": len(src_files),
                "source_bytes": src_bytes,
                "read_bytes": read_bytes,
                "page_cache": "cold (posix_fadvise DONTNEED before each read/convert step)"
                if args.cold
                else "warm (source read once before timing)",
                "source_resident_fraction_before_step": resident,
                "contention_per_repeat": contention,
                "contention": run,
                "repeat": args.repeat,
                "samples_s": samples,
                "fsync_samples_s": fsyncs,
                "gqa2mla_timings": phases,
                "medians_s": med,
                "summary": summary,
                "rss_samples": rss,
                "profile": profile,
                "torch_threads": torch.get_num_threads(),
            }
        )
        C.write_json(args.out, data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
