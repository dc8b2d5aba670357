"""Healing on SmolLM2-135M (or, with --model gemma3, Gemma 3 270M): perplexity of a
compressed conversion before and after `convert.heal` (KL distillation of the MLA
projections toward the original).

One-shot conversions as in bench/compression.py (Fisher calibration on *Pride and
Prejudice*), healed on further tokens of the same novel (disjoint from nothing on the
evaluation side), evaluated on *Emma* (4,096 tokens, windows of 1,024): nothing is
tuned on the evaluation text.

    python bench/heal.py                                  # 25% cache, both layouts (~15 min on 2 cores)
    python bench/heal.py --ratios 0.5 --layouts factored --steps 100
    python bench/heal.py --model gemma3 --layouts factored --out bench/results/heal_gemma3.json
    python bench/heal.py --layouts vllm --workdir /tmp    # the --target vllm export, healed through its
                                                          # transformers twin (written, healed, written)
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))
sys.path.insert(0, str(HERE))

import _common  # noqa: E402
import realdata  # noqa: E402

import convert  # noqa: E402

#: The real models healed (the fixture directories of bench/compression.py's MODELS).
MODELS = {"smollm2": realdata.smollm2_dir, "gemma3": realdata.gemma3_dir}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--calib-book", default="prideprejudice")
    p.add_argument("--eval-book", default="emma")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--heal-tokens", type=int, default=16384, help="tokens of the calibration book to heal on")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--ratios", default="0.25")
    p.add_argument(
        "--layouts", default="factored,absorbed", help="factored, absorbed (to_mla in memory) and vllm (the export)"
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the vllm export is written (a temporary dir)")
    p.add_argument("--method", default="fisher")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3, help="relative (convert heal --lr)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--check-every", type=int, default=25, help="convert heal --check-every (0: no checks)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "heal.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = MODELS[args.model]()
    tokenizer = AutoTokenizer.from_pretrained(src)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    book = tokenizer(realdata.austen_text(args.calib_book))["input_ids"]
    calib_ids = torch.tensor(book[: args.calib_tokens])[None]
    heal_ids = torch.tensor(book[: args.heal_tokens])[None]
    eval_ids = torch.tensor(tokenizer(realdata.austen_text(args.eval_book))["input_ids"][: args.eval_tokens])[None]
    rows = []
    result = _common.header("heal", "cpu", {"quiet": None})
    result |= {
        "model": args.model,
        "calib": {"book": args.calib_book, "tokens": calib_ids.shape[-1]},
        "heal": {
            "book": args.calib_book,
            "tokens": heal_ids.shape[-1],
            "steps": args.steps,
            "lr": args.lr,
            "window": args.window,
            "check_every": args.check_every,
        },
        "eval": {"book": args.eval_book, "tokens": eval_ids.shape[-1], "window": 1024},
        "rows": rows,
    }
    for layout in args.layouts.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")) if layout != "vllm" else [None]:
            t0 = time.perf_counter()
            heal_options = dict(
                eval_texts=eval_ids, steps=args.steps, lr=args.lr, window=args.window, tokens=args.heal_tokens,
                check_every=args.check_every, device="cpu",
            )  # fmt: skip
            if layout == "vllm":  # the export's directory: healed through its transformers twin, written
                with tempfile.TemporaryDirectory(dir=args.workdir) as work:
                    export = Path(work) / "vllm"
                    convert.gqa2mla(src, export, target="vllm", calib=calib_ids, verify=False, progress=False)
                    convert_s = time.perf_counter() - t0
                    healed = convert.heal(export, heal_ids, original=src, output=Path(work) / "healed", **heal_options)
            else:
                model = convert.to_mla(
                    original, layout=layout, kv_cache_ratio=ratio, method=args.method, calib=calib_ids, progress=False
                )
                convert_s = time.perf_counter() - t0
                healed = convert.heal(model, heal_ids, original=original, **heal_options)
            report = healed.report
            row = {
                "layout": layout,
                "ratio": ratio,
                "method": args.method,
                "convert_s": convert_s,
                "heal_s": report["seconds"],
                "ppl_original": report["before"]["ppl_original"],
                "ppl_ratio_before": report["before"]["ppl_ratio"],
                "ppl_ratio_after": report["after"]["ppl_ratio"],
                "kl_before": report["before"]["kl_mean"],
                "kl_after": report["after"]["kl_mean"],
                "train_kl_first": report["train_kl_first"],
                "train_kl_last": report["train_kl_last"],
                "train_tokens": report["train_tokens"],
                "checks": report["checks"],
            }
            rows.append(row)
            _common.write_json(args.out, result)  # after every row: a long run keeps what it measured
            cache = "vLLM's" if ratio is None else f"{ratio:.2f}"
            print(
                f"{layout:9s} {cache:6s} ×{row['ppl_ratio_before']:.3f} -> ×{row['ppl_ratio_after']:.3f} "
                f"(KL {row['kl_before']:.4f} -> {row['kl_after']:.4f}; heal {row['heal_s']:.0f} s)",
                flush=True,
            )
    print(
        _common.table(
            ["layout", "cache", "before", "after", "KL before", "KL after"],
            [
                [
                    r["layout"],
                    "vLLM's" if r["ratio"] is None else f"{r['ratio']:.0%}",
                    f"×{r['ppl_ratio_before']:.3f}",
                    f"×{r['ppl_ratio_after']:.3f}",
                    f"{r['kl_before']:.4f}",
                    f"{r['kl_after']:.4f}",
                ]
                for r in rows
            ],
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
