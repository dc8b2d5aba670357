"""Every path of the tool on one real model, at its defaults: what each costs and what it says.

Each path is one fresh `python -m convert ...` process (bench/memory.py's child: its peak resident
memory is the process's own VmHWM) run on the model as published (bfloat16), one after another,
nothing else running:

  absorbed      gqa2mla SRC                                   (the default: exact, --layout absorbed)
  factored      gqa2mla SRC --layout factored                 (exact)
  transformers  gqa2mla SRC --target transformers             (exact, DeepseekV3 for stock transformers)
  vllm          gqa2mla SRC --target vllm --max-ppl-ratio R   (lossy unless one K/V head of 64)
  llamacpp      gqa2mla SRC --target llamacpp --max-ppl-ratio R
  joint         gqa2mla SRC --latent joint                    (refused, exit 2, for a model with RoPE)
  tampered      verify SRC BROKEN, BROKEN = the absorbed output with one layer damaged
                (fixtures/tamper.py, zero_key_latent_row in the middle layer): must FAIL, exit 1
  eval          eval ABSORBED --limit N                       (lm-evaluation-harness, original and converted)

R is issue 37's one-shot goal, 1.15, unless --max-ppl-ratio says otherwise. For each path the JSON keeps
the exit code, the verdict and failures of the report the run wrote, its figures (end to end, and per kind
of text for a lossy one), the report's own stage timings (tensors copied, layers checked, end to end) and
the run's wall time and peak memory. Which verdict each path should give is in EXPECTED: the line it
prints per path ends with "as expected" or "UNEXPECTED".

    python bench/every_path.py --model qwen15b --out bench/results/every_path/every_path_qwen15b.json
    python bench/every_path.py --model smollm2-bf16 --paths absorbed,tampered   # minutes, not hours

Run it alone: the wall times are the point (qwen15b, all paths: about an hour on 2 cores, the two exports most of it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import _common
import memory

GiB = 2**30
MODELS = {  # as published: bfloat16 (the 1.5B's config.json without head_dim, as Qwen2's published ones)
    "qwen15b": lambda realdata: realdata.qwen25_coder_dir(),
    "smollm2-bf16": lambda realdata: realdata.smollm2_cast_dir("bfloat16"),
}
PATHS = ("absorbed", "factored", "transformers", "vllm", "llamacpp", "joint", "tampered", "eval")
#: The exit code each path should give: 0 PASS, 1 FAIL, 2 refused.
EXPECTED = {
    "absorbed": 0,
    "factored": 0,
    "transformers": 0,
    "vllm": 0,
    "llamacpp": 0,
    "joint": 2,
    "tampered": 1,
    "eval": 0,
}
TAMPER = "zero_key_latent_row"


def model_dir(name: str) -> Path:
    import realdata

    return Path(MODELS[name](realdata))


def convert_args(path: str, src: Path, out: Path, ratio: float) -> list[str]:
    """The command line of a gqa2mla path."""
    base = ["gqa2mla", str(src), "-o", str(out), "-q"]
    extra = {
        "absorbed": [],
        "factored": ["--layout", "factored"],
        "transformers": ["--target", "transformers"],
        "vllm": ["--target", "vllm", "--max-ppl-ratio", str(ratio)],
        "llamacpp": ["--target", "llamacpp", "--max-ppl-ratio", str(ratio)],
        "joint": ["--latent", "joint"],
    }[path]
    return base + extra


def read_report(directory: Path) -> dict:
    """What the run's verification.json says: verdict, failures, figures, stage timings."""
    report = directory / "verification.json"
    if not report.is_file():
        return {}
    data = json.loads(report.read_text())
    e2e = data.get("end_to_end") or {}
    figures = {k: e2e.get(k) for k in ("logits_rel_error", "kl_mean", "top1_agreement", "ppl_ratio", "greedy_match")}
    return {
        "verdict": data.get("verdict"),
        "failures": data.get("failures"),
        "timings": data.get("timings"),
        "memory_cap_bytes": (data.get("memory") or {}).get("cap_bytes"),
        "e2e_mode": e2e.get("mode"),
        "greedy_how": e2e.get("greedy_how"),
        "figures": figures,
        "by_text": [
            {k: r.get(k) for k in ("text", "tokens", "ppl_original", "ppl_converted", "ppl_ratio")}
            for r in e2e.get("by_text") or []
        ],
        "max_layer_rel_error": max((layer["rel_error"] for layer in data.get("layers") or []), default=None),
    }


def disk_bytes(path: Path) -> int | None:
    if not path.exists():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def run_path(path: str, src: Path, work: Path, ratio: float, eval_limit: int) -> dict:
    """One path in a fresh process: its exit, report, wall time and peak memory."""
    absorbed = work / "absorbed"
    if path == "tampered":
        if not absorbed.is_dir():
            return {"skipped": "needs the absorbed path's output (run it first)"}
        import tamper

        config = json.loads((absorbed / "config.json").read_text())
        layer = len(config["mla"]["layers"]) // 2
        broken = work / "tampered"
        shutil.rmtree(broken, ignore_errors=True)
        tamper.tampered_copy(absorbed, broken, TAMPER, layer)
        reports = work / "tampered-report"
        shutil.rmtree(reports, ignore_errors=True)
        args = ["verify", str(src), str(broken), "--report-dir", str(reports)]
        result = memory.run_child(args) | {"tamper": TAMPER, "layer": layer}
        return result | read_report(reports)
    if path == "eval":
        if not absorbed.is_dir():
            return {"skipped": "needs the absorbed path's output (run it first)"}
        table = work / "eval.json"
        args = ["eval", str(absorbed), "-o", str(table)] + (["--limit", str(eval_limit)] if eval_limit else [])
        result = memory.run_child(args)
        if table.is_file():
            result["results"] = json.loads(table.read_text())
        return result
    out = work / path
    shutil.rmtree(out, ignore_errors=True)
    result = memory.run_child(convert_args(path, src, out, ratio))
    result["args"] = convert_args(path, src, Path("OUT"), ratio)[2:]
    result["output_bytes"] = disk_bytes(out)
    return result | read_report(out)


def line(model: str, path: str, r: dict) -> str:
    """One printed line per path."""
    if "skipped" in r:
        return f"{model} {path}: skipped ({r['skipped']})"
    ok = "as expected" if r["exit"] == EXPECTED[path] else "UNEXPECTED"
    figures = r.get("figures") or {}
    worst = max(r.get("by_text") or [], key=lambda t: t["ppl_ratio"] or 0, default=None)
    said = (
        f", worst {worst['text']} x{worst['ppl_ratio']:.3f}"
        if worst
        else (f", logits rel {figures['logits_rel_error']:.2e}" if figures.get("logits_rel_error") is not None else "")
    )
    return (
        f"{model} {path}: exit {r['exit']} {r.get('verdict') or ''}{said}, {r['wall_s']:.0f} s, "
        f"peak {r['vmhwm'] / GiB:.2f} GiB — {ok}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen15b")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--max-ppl-ratio", type=float, default=1.15, help="the lossy targets' gate (issue 37's goal)")
    p.add_argument("--eval-limit", type=int, default=8, help="documents per lm-eval task (0: all)")
    p.add_argument("--workdir", type=Path, default=None, help="where the outputs go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the outputs in --workdir")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/every_path/every_path_MODEL.json")
    args = p.parse_args()
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        sys.exit(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    out = args.out or _common.result_file("every_path", f"every_path_{args.model.replace('-', '_')}.json")
    quiet = _common.wait_quiet(max_load=0.5, max_wait_s=600)
    result = _common.header("every_path", "cpu", quiet) | {"model": args.model, "paths": {}}
    src = model_dir(args.model)
    result["source"] = {"dir": src, "bytes": disk_bytes(src), "config": json.loads((src / "config.json").read_text())}
    result["baseline"] = memory.run_child([])  # a process that only imports torch, transformers and convert
    work = args.workdir or Path(tempfile.mkdtemp(prefix="every_path-", dir=src.parent))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for path in paths:
            r = run_path(path, src, work, args.max_ppl_ratio, args.eval_limit)
            r["expected_exit"] = EXPECTED[path]
            result["paths"][path] = r
            print(line(args.model, path, r), flush=True)
            _common.write_json(out, result)  # after every path: hours of work are not lost to one crash
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            path,
            r.get("exit"),
            r.get("verdict"),
            r.get("wall_s"),
            (r.get("timings") or {}).get("end_to_end_s"),
            r["vmhwm"] / GiB if "vmhwm" in r else None,
            (r.get("output_bytes") or 0) / 1e9 or None,
        ]
        for path, r in result["paths"].items()
    ]
    print(_common.table(["path", "exit", "verdict", "wall s", "end to end s", "peak GiB", "output GB"], rows))


if __name__ == "__main__":
    main()
