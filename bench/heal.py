"""Healing on SmolLM2-135M (or, with --model gemma3, Gemma 3 270M): perplexity of a
compressed conversion before and after `convert.heal` (KL distillation of the MLA
projections toward the original).

One-shot conversions as in bench/compression.py (Fisher calibration on *Pride and
Prejudice*), healed on further tokens of the same novel (disjoint from nothing on the
evaluation side), evaluated on *Emma* (4,096 tokens, windows of 1,024): nothing is
tuned on the evaluation text.

    python bench/heal.py                                  # 25% cache, both layouts (~15 min on 2 cores)
    python bench/heal.py --ratios 0.5 --layouts factored --steps 100
    python bench/heal.py --model gemma3 --layouts factored --out bench/results/heal/heal_gemma3.json
    python bench/heal.py --layouts vllm --workdir /tmp    # the --target vllm export, healed through its
                                                          # transformers twin (written, healed, written)
    python bench/heal.py --model qwen15b --workdir /tmp --steps 300 [--export DIR [--healed DIR]]
        # Qwen2.5-Coder-1.5B's vllm export (biases carried, 128-wide heads folded): calibrated and healed
        # on the shipped mix, as `convert gqa2mla` and `convert heal` read it (bf16 autocast); judged before
        # and after on the judging part of every kind of text (code first). --export: heal an export already
        # written (`convert gqa2mla SRC --target vllm`); --healed: judge its healed directory, not heal again.
"""

import argparse
import gc
import json
import subprocess
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
MODELS = {"smollm2": realdata.smollm2_dir, "gemma3": realdata.gemma3_dir, "qwen15b": realdata.qwen25_coder_dir}

#: A model's own default arguments, read before the command line's (which overrides them).
MODEL_ARGS = {
    "qwen15b": [
        *(
            "--layouts",
            "vllm",
            "--calib-shipped",
            "--eval-kind",
            "code",
            "--eval-kinds",
            "all",
            "--eval-tokens",
            "2048",
        ),
        *("--heal-tokens", "65536", "--mixed-precision", "bf16"),  # bf16 autocast: the CPU's AMX
    ],
}


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
    p.add_argument(
        "--calib-shipped",
        action="store_true",
        help="calibrate and heal on the package's shipped mix of every kind of text (as `convert gqa2mla` "
        "reads it with no --calib), not on --calib-book",
    )
    p.add_argument(
        "--eval-kind",
        default=None,
        help="judge first on the judging part of this kind of text (the healing report's before / after), "
        "not on --eval-book",
    )
    p.add_argument(
        "--eval-kinds",
        default=None,
        help="also judge on the judging part of these kinds of text (comma-separated, or 'all'), each "
        "--eval-tokens long",
    )
    p.add_argument("--mixed-precision", default="auto", help="convert heal --mixed-precision (auto: none on the CPU)")
    p.add_argument("--export", type=Path, default=None, help="vllm layout: heal this export of --model's checkpoint")
    p.add_argument(
        "--healed",
        type=Path,
        default=None,
        help="with --export: judge this healed directory of it (its healing.json the row's healing figures) "
        "instead of healing again",
    )
    p.add_argument("--judge", type=Path, default=None, help=argparse.SUPPRESS)  # internal: judge_apart's child
    p.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/heal/heal.json (qwen15b: heal_qwen15b.json)"
    )
    model = p.parse_known_args(argv)[0].model
    args = p.parse_args(MODEL_ARGS.get(model, []) + list(sys.argv[1:] if argv is None else argv))
    args.out = args.out or _common.result_file("heal", "heal.json" if model == "smollm2" else f"heal_{model}.json")
    return args


def judging_sets(args, tokenizer) -> dict[str, torch.Tensor]:
    """What each row is judged on, by name, (1, --eval-tokens) each: --eval-kind's judging part first and
    then each of --eval-kinds', else --eval-book (bench/compression.py's `judging_sets`, without files)."""
    from types import SimpleNamespace

    from compression import judging_sets as compression_sets

    return compression_sets(SimpleNamespace(**vars(args), eval_text=None), tokenizer)


def judged(model, sets: dict[str, torch.Tensor]) -> dict[str, float]:
    """Perplexity of `model` on each judging set (windows of 1,024)."""
    from convert.verify.e2e import perplexity

    return {name: perplexity(model, ids, 1024) for name, ids in sets.items()}


def judged_directory(path: Path, sets: dict[str, torch.Tensor]) -> dict[str, float]:
    """`judged` of a converted directory, opened as its target's runtime runs it (float32), then freed."""
    from convert.targets import load_output

    return judged(load_output(path, torch.device("cpu"), torch.float32).eval(), sets)


def judged_apart(path: Path, args) -> dict[str, float]:
    """`judged_directory` in a fresh process (this script with --judge): the memory a healing run used
    (both models, the optimizer's state) is not all returned to the system by the allocator, and the
    1.5B's healed model loaded beside it ran out of 24 GiB."""
    command = [sys.executable, __file__, "--model", args.model, "--judge", str(path)]
    command += ["--eval-book", args.eval_book, "--eval-tokens", str(args.eval_tokens)]
    command += ["--eval-kind", args.eval_kind] if args.eval_kind else []
    command += ["--eval-kinds", args.eval_kinds] if args.eval_kinds else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def training_ids(args, src: Path, tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration and healing ids (1, N) each: the first tokens of the shipped mix (--calib-shipped)
    or of --calib-book."""
    if args.calib_shipped:
        from compression import shipped_ids

        n = max(args.calib_tokens, args.heal_tokens)
        ids = shipped_ids(src, vocab_size, "default", n)
    else:
        ids = torch.tensor(tokenizer(realdata.austen_text(args.calib_book))["input_ids"])[None]
    return ids[:, : args.calib_tokens], ids[:, : args.heal_tokens]


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = MODELS[args.model]()
    tokenizer = AutoTokenizer.from_pretrained(src)
    if args.judge is not None:
        print(json.dumps(judged_directory(args.judge, judging_sets(args, tokenizer))))
        return
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    calib_ids, heal_ids = training_ids(args, src, tokenizer, original.config.vocab_size)
    sets = judging_sets(args, tokenizer)
    eval_ids = next(iter(sets.values()))  # the one the healing report's before / after is measured on
    ppl_original = judged(original, sets)
    if args.layouts == "vllm":  # the export is healed from its directory: the original is loaded there
        del original
        gc.collect()
    calib_name = "shipped mix" if args.calib_shipped else args.calib_book
    rows = []
    result = _common.header("heal", "cpu", {"quiet": None})
    result |= {
        "model": args.model,
        "calib": {"book": calib_name, "tokens": calib_ids.shape[-1]},
        "heal": {
            "book": calib_name,
            "tokens": heal_ids.shape[-1],
            "steps": args.steps,
            "lr": args.lr,
            "window": args.window,
            "check_every": args.check_every,
            "mixed_precision": args.mixed_precision,
        },
        "eval": {"texts": {k: v.shape[-1] for k, v in sets.items()}, "window": 1024},
        "ppl_original": ppl_original,
        "rows": rows,
    }
    for layout in args.layouts.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")) if layout != "vllm" else [None]:
            t0 = time.perf_counter()
            heal_options = dict(
                eval_texts=eval_ids, steps=args.steps, lr=args.lr, window=args.window, tokens=args.heal_tokens,
                check_every=args.check_every, device="cpu", mixed_precision=args.mixed_precision,
            )  # fmt: skip
            if layout == "vllm":  # the export's directory: healed through its transformers twin, written
                with tempfile.TemporaryDirectory(dir=args.workdir) as work:
                    export = args.export or Path(work) / "vllm"
                    if args.export is None:
                        convert.gqa2mla(src, export, target="vllm", calib=calib_ids, verify=False, progress=False)
                    convert_s = time.perf_counter() - t0
                    before = judged_directory(export, sets)
                    healed_dir = args.healed or Path(work) / "healed"
                    if args.healed is None:
                        convert.heal(export, heal_ids, original=src, output=healed_dir, **heal_options)
                    report = json.loads((healed_dir / "healing.json").read_text())
                    after = judged_apart(healed_dir, args)
            else:
                model = convert.to_mla(
                    original, layout=layout, kv_cache_ratio=ratio, method=args.method, calib=calib_ids, progress=False
                )
                convert_s = time.perf_counter() - t0
                before = judged(model, sets)
                report = convert.heal(model, heal_ids, original=original, **heal_options).report
                after = judged(model, sets)
            row = {
                "layout": layout,
                "ratio": ratio,
                "method": args.method,
                "export": None if args.export is None or layout != "vllm" else str(args.export),
                "healed": None if args.healed is None or layout != "vllm" else str(args.healed),
                "convert_s": None if args.export is not None and layout == "vllm" else convert_s,
                "heal_s": report["seconds"],
                "ppl_original": report["before"]["ppl_original"],
                "ppl_ratio_before": report["before"]["ppl_ratio"],
                "ppl_ratio_after": report["after"]["ppl_ratio"],
                "kl_before": report["before"]["kl_mean"],
                "kl_after": report["after"]["kl_mean"],
                "by_text": {
                    name: {
                        "ratio_before": before[name] / ppl_original[name],
                        "ratio_after": after[name] / ppl_original[name],
                    }
                    for name in sets
                },
                "train_kl_first": report["train_kl_first"],
                "train_kl_last": report["train_kl_last"],
                "train_tokens": report["train_tokens"],
                "checks": report["checks"],
            }
            rows.append(row)
            _common.write_json(args.out, result)  # after every row: a long run keeps what it measured
            cache = "vLLM's" if ratio is None else f"{ratio:.2f}"
            worst = max(row["by_text"].items(), key=lambda item: item[1]["ratio_after"])
            print(
                f"{layout:9s} {cache:6s} ×{row['ppl_ratio_before']:.3f} -> ×{row['ppl_ratio_after']:.3f} "
                f"(KL {row['kl_before']:.4f} -> {row['kl_after']:.4f}; heal {row['heal_s']:.0f} s; "
                f"worst after: {worst[0]} ×{worst[1]['ratio_after']:.3f})",
                flush=True,
            )
    print(
        _common.table(
            ["layout", "cache", "text", "before", "after"],
            [
                [
                    r["layout"],
                    "vLLM's" if r["ratio"] is None else f"{r['ratio']:.0%}",
                    name,
                    f"×{figures['ratio_before']:.3f}",
                    f"×{figures['ratio_after']:.3f}",
                ]
                for r in rows
                for name, figures in r["by_text"].items()
            ],
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
