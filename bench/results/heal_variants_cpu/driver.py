"""Healing variants on the CPU from one converted start (issue 33's CPU goal, <= x1.10 on Emma).

SmolLM2 factored at 25% (fisher, sequential, refined: bench/heal_curve.py's start) is converted
once; each variant heals a fresh copy of it through DistillationTrainer with the checks, as
bench/heal_curve.py does, and is judged on 4,096 tokens of Emma.

    XR_VARIANTS="base;lr=3e-3;tokens=51200" python bench/results/heal_variants_cpu/driver.py

A variant is comma-separated key=value switches (lr, steps, batch, window, tokens, check: the
checks' interval), or `base` for the defaults before 2026-11-29 (200 steps of one 256-token
window, lr 1e-3, 16,384 tokens read, checks every 25 steps). Each result line is appended to
results.txt beside this file (XR_OUT: elsewhere).
"""

import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "bench"))
import realdata  # noqa: E402

import convert  # noqa: E402
from convert.verify.e2e import compare_models  # noqa: E402

OUT = Path(os.environ.get("XR_OUT", Path(__file__).with_name("results.txt")))


def variants():
    for spec in os.environ.get("XR_VARIANTS", "base").split(";"):
        kv = dict(p.split("=") for p in spec.split(",") if "=" in p)
        yield spec, kv


def main():
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convert.healing.train import hold_out
    from convert.healing.trainer import DistillationTrainer, HealingCallback, HealingWindows
    from convert.options import HealOptions

    torch.manual_seed(0)
    src = realdata.smollm2_dir()
    tok = AutoTokenizer.from_pretrained(src)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    books = [tok(realdata.austen_text(b))["input_ids"] for b in ("prideprejudice", "sensesensibility")]
    stream = [t for book in books for t in book]
    calib_ids = torch.tensor(books[0][:4096])[None]
    eval_ids = torch.tensor(tok(realdata.austen_text("emma"))["input_ids"][:4096])[None]
    t0 = time.perf_counter()
    start = convert.to_mla(
        original, layout="factored", kv_cache_ratio=0.25, method="fisher", calibration="sequential",
        calib=calib_ids, progress=False,
    )  # fmt: skip
    print(f"converted in {time.perf_counter() - t0:.0f} s", flush=True)
    before = compare_models(original, start, eval_ids)["ppl_ratio"]
    print(f"start x{before:.4f}", flush=True)
    for spec, kv in variants():
        lr = float(kv.get("lr", 1e-3))
        opts = HealOptions(
            device="cpu", steps=int(kv.get("steps", 200)), batch_size=int(kv.get("batch", 1)),
            window=int(kv.get("window", 256)), tokens=int(kv.get("tokens", 16384)),
        ).sized()  # fmt: skip
        heal_ids = torch.tensor(stream[: opts.tokens])[None]
        train_ids, check_ids = hold_out(heal_ids, 16, "check tokens", "", most=32768)
        student = copy.deepcopy(start)
        checks = HealingCallback(original, check_ids, every=int(kv.get("check", 25)), window=opts.window)
        with tempfile.TemporaryDirectory() as work:
            training = transformers.TrainingArguments(
                output_dir=work, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
                learning_rate=lr, save_strategy="no", report_to=[], disable_tqdm=True,
                logging_steps=opts.steps, use_cpu=True,
            )  # fmt: skip
            data = HealingWindows(train_ids, opts.window, opts.steps * opts.batch_size, seed=opts.seed)
            trainer = DistillationTrainer(
                model=student, args=training, train_dataset=data, teacher=original, checks=checks
            )
            t1 = time.perf_counter()
            trainer.train()
            heal_s = time.perf_counter() - t1
        student.eval()
        fig = compare_models(original, student, eval_ids)
        rep = checks.report()
        line = (
            f"{spec:32s} emma x{before:.4f} -> x{fig['ppl_ratio']:.4f} kl {fig['kl_mean']:.4f} "
            f"heal {heal_s:.0f} s kept {rep['best_step']} halvings {rep['halvings']}"
        )
        print(line, flush=True)
        with OUT.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
