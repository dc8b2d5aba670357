#!/usr/bin/env python3
"""The test suite's wall time at two commits, side by side: was a restructuring slower?

Each commit is checked out into a scratch worktree and its own tests run there with its own
package first on the path (`PYTHONPATH`), in this interpreter's environment; the runs alternate
(base, head, head, base, ...) so that the machine's load falls on both. Medians of `--repeat`
runs each, the ratio head/base, and each run's passed/skipped/failed counts (the suites differ
by the tests the head added). `-m` selects the tests as pytest's own `-m` does.

    python bench/suite_time.py [--base a4be367] [--head HEAD] [--repeat 2] [-m "not slow"]
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

#: The last commit before issue 35's restructuring (targets/vllm.py split into targets/vllm/).
BEFORE_ISSUE_35 = "a4be367"
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?)")


def worktree(rev: str, into: Path) -> Path:
    """A detached checkout of `rev` under `into`."""
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(C.REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def run_suite(tree: Path, marker: str) -> dict:
    """One pytest run of `tree`'s suite: wall seconds and the counts its summary line gives."""
    env = os.environ | {"PYTHONPATH": f"{tree}{os.pathsep}{tree / 'fixtures'}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    counts = {"error" if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(summary)}
    return {"seconds": round(seconds, 1), "exit": done.returncode, "counts": counts, "summary": summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BEFORE_ISSUE_35)
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("-m", dest="marker", default="not slow", help="pytest's -m expression")
    parser.add_argument("--out", type=Path, default=C.result_file("suite_time"))
    args = parser.parse_args(argv)

    revs = {
        name: subprocess.check_output(["git", "-C", str(C.REPO), "rev-parse", "--short", rev], text=True).strip()
        for name, rev in (("base", args.base), ("head", args.head))
    }
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="suite-time-") as scratch:
        trees: dict[str, Path] = {}
        try:
            for name, rev in revs.items():
                trees[name] = worktree(rev, Path(scratch))
            for i in range(args.repeat):
                order = ("base", "head") if i % 2 == 0 else ("head", "base")
                for name in order:
                    result = run_suite(trees[name], args.marker)
                    runs[name].append(result)
                    print(f"{name} {revs[name]}: {result['seconds']:.0f} s  {result['summary']}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(C.REPO), "worktree", "remove", "--force", str(tree)], check=False)

    medians = {name: C.median([r["seconds"] for r in rs]) for name, rs in runs.items()}
    ratio = medians["head"] / medians["base"]
    print(
        f"\nmedian: base {revs['base']} {medians['base']:.0f} s, head {revs['head']} {medians['head']:.0f} s, "
        f"head/base x{ratio:.3f}"
    )
    C.write_json(
        args.out,
        {
            "command": C.command_line(),
            "machine": C.machine(),
            "marker": args.marker,
            "revs": revs,
            "runs": runs,
            "median_seconds": medians,
            "ratio_head_over_base": ratio,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
