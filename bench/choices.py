#!/usr/bin/env python3
"""What each choice of `--layout`, `--kv-cache-ratio` and `--target` does to the checkpoint and the KV cache.

Converts the cached SmolLM2-135M-Instruct (float32) once per choice (`verify=False`; compression
and the vllm export calibrate on 4,096 tokens of Pride and Prejudice) and records the weight files'
size on disk, the KV cache per token (all layers, in the checkpoint's dtype, as `result.sizes`
reports it) and the conversion's time. Rewrites the README's table between its `choices-table`
markers (and `--layout`/`--target`'s help quotes these figures).

    python bench/choices.py [--workdir DIR] [--out bench/results/choices/choices.json] [--readme README.md]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MB = 1e6
#: (label, what it does, gqa2mla options)
CHOICES = [
    ("`--layout absorbed` (default)", "exact", {"layout": "absorbed"}),
    ("`--layout factored`", "exact", {"layout": "factored"}),
    ("`--layout factored --kv-cache-ratio 0.5`", "lossy", {"layout": "factored", "kv_cache_ratio": 0.5}),
    ("`--target transformers`", "exact", {"target": "transformers"}),
    ("`--target vllm`", "lossy", {"target": "vllm"}),
]
BEGIN, END = "<!-- choices-table: bench/choices.py -->", "<!-- /choices-table -->"


def weight_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def measure(src: Path, work: Path, calib: Path) -> dict:
    """Convert `src` once per choice; sizes, cache and time of each."""
    import convert

    rows = []
    for label, exactness, options in CHOICES:
        out = work / f"choice-{len(rows)}"
        needs_calib = "kv_cache_ratio" in options or options.get("target") == "vllm"
        extra = {"calib": calib} if needs_calib else {}
        t0 = time.perf_counter()
        result = convert.gqa2mla(src, out, verify=False, progress=False, force=True, **options, **extra)
        seconds = time.perf_counter() - t0
        sizes = result.sizes
        rows.append(
            {
                "choice": label,
                "exactness": exactness,
                "options": options,
                "checkpoint_bytes": weight_bytes(out),
                "kv_cache_bytes_per_token": sizes["kv_cache_bytes_per_token_after"],
                "convert_s": seconds,
            }
        )
        print(
            f"{label}: {rows[-1]['checkpoint_bytes'] / MB:.0f} MB, {rows[-1]['kv_cache_bytes_per_token']:,} B/token",
            flush=True,
        )
        shutil.rmtree(out)
    return {
        "source_bytes": weight_bytes(src),
        "source_kv_cache_bytes_per_token": sizes["kv_cache_bytes_per_token_before"],
        "rows": rows,
    }


def markdown(result: dict) -> str:
    src, cache = result["source_bytes"], result["source_kv_cache_bytes_per_token"]
    lines = [
        "| choice | conversion | checkpoint (SmolLM2-135M, float32) | KV cache per token |",
        "|---|---|---:|---:|",
        f"| the GQA source | — | {src / MB:.0f} MB | {cache:,} B |",
    ]
    for r in result["rows"]:
        size, kv = r["checkpoint_bytes"], r["kv_cache_bytes_per_token"]
        lines.append(
            f"| {r['choice']} | {r['exactness']} | {size / MB:.0f} MB ({size / src - 1:+.0%}) "
            f"| {kv:,} B ({kv / cache - 1:+.0%}) |"
        )
    return "\n".join(lines)


def render(result: dict, readme: Path) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no '{BEGIN}' ... '{END}' block to rewrite")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + f"{BEGIN}\n{markdown(result)}\n{END}" + rest.split(END, 1)[1])
    print(f"rewrote the table in {readme}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "choices", repeat=1)
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--readme", type=Path, default=C.REPO / "README.md", help="README whose table is rewritten")
    parser.add_argument("--render", action="store_true", help="measure nothing: rewrite the table from --out")
    args = parser.parse_args(argv)
    if args.render:
        render(_read(args.out), args.readme)
        return 0
    result = C.header("choices", "cpu", C.wait_quiet(args.max_load, args.wait, args.max_busy))
    work = Path(tempfile.mkdtemp(prefix="convert-bench-choices-", dir=args.workdir))
    try:
        result |= measure(C.smollm2_dir(), work, C.austen_file("prideprejudice"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    C.write_json(args.out, result)
    print(markdown(result))
    render(result, args.readme)
    return 0


def _read(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
