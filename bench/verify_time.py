#!/usr/bin/env python3
"""Time of `convert.verify.verify_paths` on a SmolLM2-135M conversion, with real text.

One conversion (`--layout`, default absorbed; `verify=False`) is made once,
untimed. Then, per repeat, every configuration of tokens × dtype runs
`verify_paths(original, converted, text=<Austen's Emma>, tokens=N,
device=..., dtype=..., progress=False)` in an order that rotates from repeat
to repeat (interleaved). The report's own timings give:

  per layer     layers_s / n_layers: the original decoder layer (on the hidden
                states that really reach it) and the converted attention on
                the same inputs, one layer in memory at a time
  end to end    end_to_end_s: both whole models, logits/KL/top-1/perplexity
                on the text, 32 greedy tokens each, cache bytes
  total         total_s: also opening/hashing the files (sha256 of both
                checkpoints), tokenizing, thresholds

    python bench/verify_time.py [--repeat 1] [--tokens 256 1024] [--dtypes float32 float64]

The default is one repeat (about 3-4 minutes on 2 CPU cores): verification
dominates its own run, and five repeats would take ~20 minutes.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # One repeat of the four configurations takes ~3-4 min on 2 cores: 5 would not fit in ~5 minutes.
    C.add_common_args(parser, "verify_time", repeat=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64", "bfloat16", "float16"]
    )
    parser.add_argument("--layout", default="absorbed", choices=["absorbed", "factored"])
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--text", type=Path, default=None, help="text file (default: Austen's Emma from fixtures/realdata.py)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory for the conversion (default: $TMPDIR)"
    )
    args = parser.parse_args(argv)

    import torch

    import convert
    from convert.mla.model import read_mla_config
    from convert.verify import resolve_device, verify_paths

    device = str(resolve_device(args.device))
    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    src = C.smollm2_dir()
    text = args.text or C.austen_file("emma")
    work = Path(tempfile.mkdtemp(prefix="convert-bench-verify-", dir=args.workdir))
    try:
        out = work / f"smollm2-{args.layout}"
        t0 = time.perf_counter()
        convert.gqa2mla(src, out, layout=args.layout, verify=False, progress=False, force=True)
        convert_s = time.perf_counter() - t0
        n_layers = read_mla_config(out)[1].n_layers
        print(f"converted {src.name} ({args.layout}) in {convert_s:.1f} s; text {text}; device {device}", flush=True)

        configs = [(n, dt) for n in args.tokens for dt in args.dtypes]
        samples = {f"{n}:{dt}": [] for n, dt in configs}
        verdicts = {f"{n}:{dt}": [] for n, dt in configs}
        contention = []
        # Warm-up (untimed): tokenizer, transformers imports, first-call kernels.
        verify_paths(src, out, text=text, tokens=min(args.tokens), device=device, dtype=args.dtypes[0], progress=False)
        for rep in range(args.repeat):
            watch = C.Contention()
            for n, dt in C.rotate(configs, rep):
                t0 = time.perf_counter()
                report = verify_paths(src, out, text=text, tokens=n, device=device, dtype=dt, progress=False)
                wall = time.perf_counter() - t0
                timings = dict(report["timings"], wall_s=wall)
                samples[f"{n}:{dt}"].append(timings)
                verdicts[f"{n}:{dt}"].append(
                    {
                        "verdict": report["verdict"],
                        "tokens": report["inputs"]["text"]["tokens"],
                        "max_layer_rel_error": max(r["rel_error"] for r in report["layers"]),
                        "logits_rel_error": (report["end_to_end"] or {}).get("logits_rel_error"),
                        "top1_agreement": (report["end_to_end"] or {}).get("top1_agreement"),
                        "ppl_original": (report["end_to_end"] or {}).get("ppl_original"),
                    }
                )
            contention.append(watch.report())
            print(
                f"repeat {rep + 1}/{args.repeat}: "
                + ", ".join(f"{k} {v[-1]['total_s']:.1f}s" for k, v in samples.items())
                + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
                flush=True,
            )

        summary, rows = {}, []
        for n, dt in configs:
            key = f"{n}:{dt}"
            runs = samples[key]
            med = {k: C.median([r.get(k) for r in runs]) for k in ("layers_s", "end_to_end_s", "total_s", "wall_s")}
            med["per_layer_s"] = med["layers_s"] / n_layers
            med["other_s"] = med["total_s"] - med["layers_s"] - (med["end_to_end_s"] or 0)
            last = verdicts[key][-1]
            summary[key] = {"tokens": n, "dtype": dt, **med, **last}
            rows.append(
                [
                    n,
                    dt,
                    med["per_layer_s"] * 1e3,
                    med["layers_s"],
                    med["end_to_end_s"],
                    med["other_s"],
                    med["total_s"],
                    last["verdict"],
                    last["max_layer_rel_error"],
                    last["logits_rel_error"],
                ]
            )

        print(
            f"\n### verify_paths on SmolLM2-135M ({args.layout}), text: Austen's Emma; device {device}; "
            f"medians of {args.repeat}\n"
        )
        print(
            C.table(
                [
                    "tokens",
                    "dtype",
                    "per layer ms",
                    f"all {n_layers} layers s",
                    "end to end s",
                    "other s",
                    "total s",
                    "verdict",
                    "max layer rel err",
                    "logits rel err",
                ],
                rows,
            )
        )
        run = whole_run.report()
        print("\n" + C.contention_line(run))

        data = C.header("verify_time", device, quiet)
        data.update(
            {
                "source": str(src),
                "layout": args.layout,
                "text": str(text),
                "n_layers": n_layers,
                "conversion_s": convert_s,
                "repeat": args.repeat,
                "samples": samples,
                "results": verdicts,
                "summary": summary,
                "contention_per_repeat": contention,
                "contention": run,
                "torch_threads": torch.get_num_threads(),
            }
        )
        C.write_json(args.out, data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
