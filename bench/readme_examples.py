#!/usr/bin/env python3
"""Run the README's examples as written and time each; rewrite the `# ~N s` line that opens each.

The `fast` examples (the shipped fixture) and then the `real` ones (SmolLM2 and the Austen novels),
each kind in order in one scratch directory, exactly as tests/docs/test_readme.py runs them
(fixtures/readme_examples.py). Writes bench/results/readme_examples/readme_examples.json (each example's code,
without its time line, and seconds) and, unless `--no-rewrite`, puts the measured times into the
README, so what it says is what was measured.

    python bench/readme_examples.py [--kinds fast,real] [--workdir DIR] [--no-rewrite] [--lines 61,89,136]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.REPO / "fixtures"))
import readme_examples as rx  # noqa: E402


def rewrite(readme: Path, timed: list[tuple[rx.Example, float]]) -> None:
    """Replace (or add) each example's first line with its measured time."""
    text = readme.read_text()
    for example, seconds in timed:
        new = f"{rx.format_time(seconds)}\n{example.body}\n"
        fence = f"```{example.language}\n"
        old = fence + example.code
        if old not in text:
            raise SystemExit(f"README line {example.line}: the example changed while it ran")
        text = text.replace(old, fence + "# " + new, 1)
    readme.write_text(text)


def _previous(path: Path) -> list[dict]:
    """The rows of an earlier run's results (none if there is no such file)."""
    return json.loads(path.read_text())["examples"] if path.is_file() else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "readme_examples", repeat=1)
    parser.add_argument("--kinds", default="fast,real", help="comma-separated example kinds to run")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--no-rewrite", action="store_true", help="leave the README's time lines as they are")
    parser.add_argument(
        "--lines",
        default=None,
        help="comma-separated README lines of the examples to run (the lines of their opening fences; the other rows kept): "
        "with every earlier example they need (the real ones need the first, which links data/)",
    )
    args = parser.parse_args(argv)
    result = C.header("readme_examples", "cpu", C.wait_quiet(args.max_load, args.wait, args.max_busy))
    rows, timed = [], []
    for kind in args.kinds.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"convert-readme-{kind}-", dir=args.workdir))
        try:
            env = rx.prepare(work)
            only = None if args.lines is None else {int(n) for n in args.lines.split(",")}
            for example in (e for e in rx.examples() if e.kind == kind and (only is None or e.line in only)):
                seconds, _, _ = rx.run(example, work, env)
                print(f"{kind} example at line {example.line}: {seconds:.1f} s", flush=True)
                rows.append({"kind": kind, "line": example.line, "code": example.body, "seconds": seconds})
                timed.append((example, seconds))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ran = {row["code"] for row in rows}
    kinds = args.kinds.split(",")
    current = {e.body for e in rx.examples()}  # rows of examples since changed or removed are dropped
    kept = [
        r
        for r in _previous(args.out)
        if (r["kind"] not in kinds or args.lines) and r["code"] not in ran and r["code"] in current
    ]
    result["examples"] = kept + rows
    C.write_json(args.out, result)
    if not args.no_rewrite:
        rewrite(rx.README, timed)
        print(f"rewrote the time lines of {len(timed)} examples in {rx.README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
