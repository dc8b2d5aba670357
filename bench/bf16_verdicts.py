#!/usr/bin/env python3
"""Half-precision verdicts on the real SmolLM2-135M: exact conversions against the noise floor, and
deliberately broken ones.

For each checkpoint dtype (SmolLM2 stored in bfloat16 / float16 as published checkpoints are, and
float32) and layout, the exact conversion is verified on `--tokens` tokens of Emma; the report's
figures are divided by their bounds. Where the noise floor decides (half precision), the ratios
conversion / twin per layer (max, median) and end to end are what `FLOOR_FACTOR` is chosen from
(docs/design.md, "Verification"). Then each tamper of fixtures/tamper.py is applied to one layer and
verified on `--tamper-tokens` tokens: the verdict and how far each failed figure is over its bound.

    python bench/bf16_verdicts.py [--dtypes bfloat16 float16 float32] [--layouts absorbed factored]
                                  [--tokens 1024] [--tamper-tokens 256] [--layer 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _ratios(report: dict) -> dict:
    """The conversion's figures over the twin's (null where no floor was measured)."""
    layers = [r["rel_error"] / r["floor_rel_error"] for r in report["layers"] if r.get("floor_rel_error")]
    e2e = report["end_to_end"] or {}
    floor = e2e.get("floor")
    out = {
        "layer_ratio_max": max(layers, default=None),
        "layer_ratio_median": statistics.median(layers) if layers else None,
        "layer_ratio_argmax": layers.index(max(layers)) if layers else None,
    }
    if floor:
        for key in ("logits_rel_error", "logits_max_abs_diff", "kl_mean", "kl_max", "nll_abs_diff_mean"):
            out[f"{key}_ratio"] = e2e[key] / floor[key] if floor[key] else None
        out["top1_disagreement"] = (1 - e2e["top1_agreement"], 1 - floor["top1_agreement"])
    return out


def _failed(report: dict) -> list[dict]:
    return [
        {"check": c["name"], "value": c["value"], "bound": c["bound"], "over": c["over"]}
        for c in report["decision"]["checks"]
        if not c["ok"]
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "bf16_verdicts", repeat=1)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--layouts", nargs="+", default=["absorbed", "factored"])
    parser.add_argument("--tokens", type=int, default=1024, help="Emma tokens for the exact conversions")
    parser.add_argument("--tamper-tokens", type=int, default=256, help="Emma tokens for the broken ones")
    parser.add_argument("--layer", type=int, default=5, help="the layer the tampers damage")
    args = parser.parse_args(argv)

    import realdata
    from tamper import TAMPERS, tampered_copy

    import convert
    from convert.verify import verify_paths

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    text = C.austen_file("emma")
    result = C.header("bf16_verdicts", "cpu", quiet) | {"tokens": args.tokens, "tamper_tokens": args.tamper_tokens}
    rows, tamper_rows, runs = [], [], []
    work = Path(tempfile.mkdtemp(prefix="convert-bench-bf16-"))
    try:
        for dtype in args.dtypes:
            src = realdata.smollm2_dir() if dtype == "float32" else realdata.smollm2_cast_dir(dtype)
            for layout in args.layouts:
                out = work / f"{dtype}-{layout}"
                convert.gqa2mla(src, out, layout=layout, verify=False, progress=False)
                report = verify_paths(src, out, text=text, tokens=args.tokens, progress=False)
                run = {"dtype": dtype, "layout": layout, "verdict": report["verdict"], **_ratios(report)}
                run["rule"], run["timings"], run["tampers"] = report["decision"]["rule"], report["timings"], {}
                rows.append([dtype, layout, report["verdict"], run["layer_ratio_max"], run["layer_ratio_median"]])
                rows[-1] += [run.get("logits_rel_error_ratio"), run.get("kl_mean_ratio"), report["timings"]["total_s"]]
                print(f"{dtype} {layout}: {report['verdict']}, {run}", flush=True)
                for kind in TAMPERS:
                    broken = tampered_copy(out, work / f"{dtype}-{layout}-{kind}", kind, args.layer)
                    bad = verify_paths(src, broken, text=text, tokens=args.tamper_tokens, progress=False)
                    run["tampers"][kind] = {"verdict": bad["verdict"], "failed": _failed(bad)}
                    overs = ", ".join(f"{f['check']} {f['over']:.1f}x" for f in _failed(bad))
                    tamper_rows.append([dtype, layout, kind, bad["verdict"], overs])
                    print(f"  {kind}: {bad['verdict']} ({overs})", flush=True)
                    shutil.rmtree(broken)
                runs.append(run)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headers = ["dtype", "layout", "verdict", "layer ×floor max", "median", "logits ×floor", "KL ×floor", "verify s"]
    print(f"\n### Exact conversions of SmolLM2 on {args.tokens} tokens of Emma\n\n" + C.table(headers, rows))
    print(f"\n### Layer {args.layer} broken, {args.tamper_tokens} tokens: failed checks, × their bound\n")
    print(C.table(["dtype", "layout", "tamper", "verdict", "failed checks (× bound)"], tamper_rows))
    C.write_json(args.out, result | {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
