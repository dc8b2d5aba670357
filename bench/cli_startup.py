#!/usr/bin/env python3
"""How fast the command line answers when no tensor is needed: wall time and peak RSS.

Commands: `--help`, `--version`, `gqa2mla --help`, `gqa2mla --bogus-flag` (a usage error)
and `gqa2mla /nonexistent` (a refusal that needs no tensor), each in a fresh process:
  light   `python cli.py ARGS`: the code the `convert` entry point runs (setup.cfg: cli:main),
          which imports the package without torch and transformers
  full    `python -m convert ARGS`: the same command after a full `import convert` (torch,
          transformers, the Auto-class registration), which is what every call paid before
plus two references: `python -c pass` (the interpreter alone) and `python -c "import convert"`.
Variants are interleaved (the order rotates from repeat to repeat); medians are quoted. Peak
RSS is GNU time's %M: a child forked by this (torch-importing) process would report this
process's RSS as its own high-water mark. A run that imported torch is flagged (one extra run
with -X importtime). Goal: every light command ≤ 1 s and ≤ 60 MB.

    python bench/cli_startup.py [--repeat 7] [--wait 600]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TIME_GOAL_S, RSS_GOAL_MB = 1.0, 60.0
MB = 2**20
GNU_TIME = Path("/usr/bin/time")
COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "gqa2mla --help": ["gqa2mla", "--help"],
    "gqa2mla --bogus-flag": ["gqa2mla", "--bogus-flag"],
    "gqa2mla /nonexistent": ["gqa2mla", "/nonexistent"],
    "gqa2mla -o <not convert's>": ["gqa2mla", "fixtures/tiny-llama", "-o", "README.md"],
}
REFERENCES = {"python -c pass": ["-c", "pass"], "import convert": ["-c", "import convert"]}


def variants() -> dict[str, list[str]]:
    """name -> the interpreter's arguments."""
    runs = {f"light: {name}": [str(C.REPO / "cli.py"), *args] for name, args in COMMANDS.items()}
    runs |= {f"full: {name}": ["-m", "convert", *args] for name, args in COMMANDS.items()}
    return runs | REFERENCES


def run_child(args: list[str]) -> dict:
    """One fresh interpreter: exit code, wall seconds and its own peak RSS (bytes)."""
    env = {k: v for k, v in os.environ.items() if k != "CONVERT_LIGHT_IMPORT"}
    with tempfile.NamedTemporaryFile("r") as rss:
        start = time.perf_counter()
        done = subprocess.run(
            [str(GNU_TIME), "-q", "-f", "%M", "-o", rss.name, sys.executable, *args],
            capture_output=True,
            cwd=C.REPO,
            env=env,
        )
        wall = time.perf_counter() - start
        peak_kib = int(rss.read().split()[-1])
    return {"exit": done.returncode, "wall_s": wall, "peak_rss": peak_kib * 1024}


def imports_torch(args: list[str]) -> bool:
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=C.REPO)
    return re.search(r"\|\s*torch$", done.stderr, flags=re.M) is not None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "cli_startup", repeat=7)
    args = parser.parse_args(argv)
    if not GNU_TIME.is_file():
        parser.error(f"needs GNU time at {GNU_TIME} for the peak RSS (apt-get install time)")

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    result = C.header("cli_startup", "cpu", quiet)
    runs = variants()
    samples = {name: [] for name in runs}
    contention = []
    for rep in range(args.repeat):
        watch = C.Contention()
        for name in C.rotate(list(runs), rep):
            samples[name].append(run_child(runs[name]))
        contention.append(watch.report())
        print(f"repeat {rep + 1}/{args.repeat}; other processes used {contention[-1]['other_cpu_cores']} cores")

    summary = {}
    for name, runs_of in samples.items():
        light = name.startswith("light: ")
        summary[name] = {
            "command": runs[name],
            "exit": sorted({r["exit"] for r in runs_of}),
            "wall_s": C.median([r["wall_s"] for r in runs_of]),
            "peak_rss_mb": C.median([r["peak_rss"] / MB for r in runs_of]),
            "imports_torch": imports_torch(runs[name]),
        }
        if light:
            s = summary[name]
            s["meets_goal"] = s["wall_s"] <= TIME_GOAL_S and s["peak_rss_mb"] <= RSS_GOAL_MB and not s["imports_torch"]
    result |= {
        "goal": {"wall_s": TIME_GOAL_S, "peak_rss_mb": RSS_GOAL_MB, "torch": False},
        "repeat": args.repeat,
        "samples": samples,
        "contention_per_repeat": contention,
        "summary": summary,
        "contention": whole_run.report(),
    }

    rows = []
    for name in COMMANDS:
        light, full = summary[f"light: {name}"], summary[f"full: {name}"]
        rows.append(
            [name, light["wall_s"], light["peak_rss_mb"], "yes" if light["imports_torch"] else "no"]
            + [full["wall_s"], full["peak_rss_mb"], full["wall_s"] / light["wall_s"], ",".join(map(str, light["exit"]))]
            + ["yes" if light["meets_goal"] else "no"]
        )
    for name in REFERENCES:
        ref = summary[name]
        rows.append(
            [f"({name})", ref["wall_s"], ref["peak_rss_mb"], "yes" if ref["imports_torch"] else "no"] + [None] * 5
        )
    headers = ["command", "light s", "light MB", "torch", "full s", "full MB", "full / light", "exit", "goal"]
    print(C.table(headers, rows))
    print(f"goal: light ≤ {TIME_GOAL_S} s and ≤ {RSS_GOAL_MB:.0f} MB (peak RSS), without torch")
    print(C.contention_line(result["contention"]))
    C.write_json(args.out, result)
    return 0 if all(s.get("meets_goal", True) for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
