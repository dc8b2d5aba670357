"""Healing's curve: perplexity ratio to the original against healing tokens, with the defaults of
the device (`convert.options.HEAL_SIZES`), through transformers' `Trainer` (`DistillationTrainer`,
the same run as `convert heal`: tests/heal/test_trainer.py).

SmolLM2 converted at --ratio of the cache (factored, Fisher, sequential calibration and refinement
on the first --calib-tokens of the first healing book, the package's defaults), healed on the
concatenation of two novels, judged every --every steps on a third (windows of 1,024). Writes
bench/results/heal_curve/heal_curve_<device>.json and a PNG beside it.

    python bench/heal_curve.py                       # CPU: 1,000 steps of 256 tokens (~1 h on 2 cores)
    python bench/heal_curve.py --device cuda         # a GPU's sizes: 2,000 steps of 8 x 1,024 tokens
    python bench/heal_curve.py --heal-books emma,persuasion --eval-book prideprejudice
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
from convert.verify.e2e import compare_models  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heal-books", default="prideprejudice,sensesensibility", help="two (or more) novels to heal on")
    p.add_argument("--eval-book", default="emma", help="the novel it is judged on (never trained on)")
    p.add_argument("--ratio", type=float, default=0.25, help="share of the KV cache kept")
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=convert.ConvertOptions.calib_tokens,
        help="the Fisher statistics read the first --fisher-tokens of them (the package's default)",
    )
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--every", type=int, default=None, help="judge every N steps; default: the checks'")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=None, help="default: the device's (HEAL_SIZES)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the device's")
    p.add_argument("--window", type=int, default=None, help="default: the device's")
    p.add_argument("--tokens", type=int, default=None, help="healing tokens read; default: the device's")
    p.add_argument("--lr", type=float, default=1e-3, help="relative, as convert heal --lr")
    p.add_argument("--check-every", type=int, default=None, help="default: the device's (HEAL_SIZES)")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/heal_curve/heal_curve_<device>.json")
    return p.parse_args(argv)


class Curve:
    """A `TrainerCallback` judging the model every `every` steps: (step, tokens, perplexity ratio)."""

    def __init__(self, original, eval_ids, every: int, tokens_per_step: int) -> None:
        self.original, self.eval_ids, self.every, self.tokens_per_step = original, eval_ids, every, tokens_per_step
        self.points: list[dict] = []

    def judge(self, model, step: int) -> None:
        was = model.training
        model.eval()
        figures = compare_models(self.original, model, self.eval_ids.to(model.device))
        model.train(was)
        self.points.append(
            {
                "step": step,
                "tokens": step * self.tokens_per_step,
                "ppl_ratio": figures["ppl_ratio"],
                "kl": figures["kl_mean"],
            }
        )
        print(f"step {step:5d}  tokens {step * self.tokens_per_step:>10,}  ppl ×{figures['ppl_ratio']:.4f}", flush=True)


def _callback(curve: Curve):
    from transformers import TrainerCallback

    class Judge(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % curve.every == 0 and state.global_step < state.max_steps:
                curve.judge(model, state.global_step)
            return control

    return Judge()


def _plot(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["tokens"] for p in points], [p["ppl_ratio"] for p in points], marker="o")
    ax.axhline(1.10, color="grey", linestyle="--", linewidth=0.8, label="×1.10 (the CPU goal)")
    ax.set_xlabel("healing tokens")
    ax.set_ylabel("perplexity ÷ the original's")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convert.healing.train import hold_out
    from convert.healing.trainer import DistillationTrainer, HealingCallback, HealingWindows
    from convert.options import HealOptions

    opts = HealOptions(
        device=args.device, steps=args.steps, batch_size=args.batch_size, window=args.window, tokens=args.tokens,
        check_every=args.check_every,
    ).sized()  # fmt: skip
    device = opts.torch_device
    src = realdata.smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    books = [tokenizer(realdata.austen_text(b))["input_ids"] for b in args.heal_books.split(",")]
    calib_ids = torch.tensor(books[0][: args.calib_tokens])[None]
    heal_ids = torch.tensor([t for book in books for t in book][: opts.tokens])[None]
    eval_ids = torch.tensor(tokenizer(realdata.austen_text(args.eval_book))["input_ids"][: args.eval_tokens])[None]

    t0 = time.perf_counter()
    student = convert.to_mla(
        original, layout="factored", kv_cache_ratio=args.ratio, method="fisher", calibration="sequential",
        calib=calib_ids, progress=False,
    )  # fmt: skip
    convert_s = time.perf_counter() - t0
    original.to(device)
    student.to(device)
    train_ids, check_ids = hold_out(heal_ids, 16, "check tokens", "", most=32768)  # as convert heal does
    per_step = opts.batch_size * opts.window
    curve = Curve(original, eval_ids, args.every or opts.check_every or opts.steps, per_step)
    checks = HealingCallback(original, check_ids, every=opts.check_every, window=opts.window)
    with tempfile.TemporaryDirectory() as work:
        training = transformers.TrainingArguments(
            output_dir=work, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
            learning_rate=args.lr, save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=opts.steps,
            use_cpu=device.type == "cpu", bf16=device.type == "cuda",
        )  # fmt: skip
        data = HealingWindows(train_ids, opts.window, opts.steps * opts.batch_size, seed=opts.seed)
        trainer = DistillationTrainer(
            model=student, args=training, train_dataset=data, teacher=original, checks=checks,
            callbacks=[_callback(curve)],
        )  # fmt: skip
        curve.judge(student, 0)
        t1 = time.perf_counter()
        trainer.train()
        heal_s = time.perf_counter() - t1
    curve.judge(student, opts.steps)  # the weights kept at the end: the best checked
    name = f"heal_curve_{device.type}"
    out = args.out or _common.result_file("heal_curve", f"{name}.json")
    result = _common.header(name, device.type, {"quiet": None})
    result |= {
        "model": "smollm2",
        "ratio": args.ratio,
        "calib_tokens": int(calib_ids.shape[-1]),
        "heal_books": args.heal_books,
        "eval_book": args.eval_book,
        "eval_tokens": int(eval_ids.shape[-1]),
        "heal_tokens_read": int(heal_ids.shape[-1]),
        "sizes": {k: getattr(opts, k) for k in ("steps", "batch_size", "window", "tokens", "check_every")},
        "lr": args.lr,
        "convert_s": convert_s,
        "heal_s": heal_s,
        "kept_step": checks.report()["best_step"],
        "halvings": checks.report()["halvings"],
        "points": curve.points,
    }
    _common.write_json(out, result)
    title = (
        f"SmolLM2 factored at {args.ratio:.0%} of the cache ({device.type})\n"
        f"healed on {args.heal_books}, judged on {args.eval_book}"
    )
    _plot(curve.points, out.with_suffix(".png"), title)
    first, last = curve.points[0]["ppl_ratio"], curve.points[-1]["ppl_ratio"]
    print(f"×{first:.4f} -> ×{last:.4f} in {heal_s:.0f} s ({opts.steps} steps of {per_step} tokens); {out}")


if __name__ == "__main__":
    main()
