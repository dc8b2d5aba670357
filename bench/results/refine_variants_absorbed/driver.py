"""The driver of the absorbed layout's refinement variants in docs/compression.md ("absorbed at 50%").

SmolLM2, absorbed at 50% (XR_RATIO), Fisher, calibrated on 4,096 tokens of Pride and Prejudice, judged on 4,096 of
Emma and of Northanger Abbey; one run per variant, each appending one line to results.txt beside it. Switches (no
patch needed): XR_CAL (--calibration, default original), XR_STEPS (--refine-steps, default 50), XR_LR (the
refinement's relative rate, default the package's 3e-3), XR_ANGLE (--nope-angle), XR_LAYOUT, XR_TAG (the line's
name). E.g. `XR_TAG=steps100 XR_STEPS=100 python bench/results/refine_variants_absorbed/driver.py`.
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import compression as bench  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from convert.compress import refine  # noqa: E402

rate = float(os.environ.get("XR_LR", "3e-3"))
sized = refine.Refinement.sized.__func__  # the package's sizing, with the rate replaced
refine.Refinement.sized = classmethod(lambda cls, steps: dataclasses.replace(sized(cls, steps), lr=rate))

torch.manual_seed(0)
src = bench.MODELS["smollm2"][0]()
tokenizer = AutoTokenizer.from_pretrained(src)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
ratio = float(os.environ.get("XR_RATIO", "0.5"))
layout = os.environ.get("XR_LAYOUT", "absorbed")
calibration = os.environ.get("XR_CAL", "original")
steps = int(os.environ.get("XR_STEPS", "50"))
angle = os.environ.get("XR_ANGLE")
calib = bench.token_ids(tokenizer, "prideprejudice", 4096)
evals = {book: bench.token_ids(tokenizer, book, 4096) for book in ("emma", "northangerabbey")}
base = {book: bench.perplexity(model, ids, 1024) for book, ids in evals.items()}
nope_angle = None if angle is None else float(angle)
row, mla = bench.run_one(model, calib, evals["emma"], 1024, "fisher", layout, ratio, nope_angle, calibration, steps)
ratios = {book: bench.perplexity(mla, ids, 1024) / base[book] for book, ids in evals.items()}
switches = {k: v for k, v in os.environ.items() if k.startswith("XR_")}
line = (
    f"{switches.get('XR_TAG', '?')} emma {ratios['emma']:.4f} NA {ratios['northangerabbey']:.4f} "
    f"convert_s {row['convert_s']:.0f} {switches}"
)
print(line, flush=True)
with open(HERE / "results.txt", "a") as f:
    f.write(line + "\n")
