"""The driver of the refinement variants in docs/compression.md ("What else was tried").

Needs the temporary switches of patch.diff (not kept in the package): from the repository root at
b560bbc, `git apply bench/results/refine_variants/patch.diff`, then one run per variant, e.g.
`XR_TAG=mlp XR_MLP=1 python bench/results/refine_variants/driver.py`. Switches: XR_ONLY (trained
tensor names), XR_WD (decay toward the closed form), XR_BATCH, XR_LR, XR_OF (full / diag: the
error weighted by the layer output's Fisher), XR_ALPHA (identity added to it), XR_MLP (the layer's
MLP trained too). SmolLM2, factored at 25%, Fisher, sequential, 50 refinement steps; calibrated on
4,096 tokens of Pride and Prejudice, judged on 4,096 of Emma and of Northanger Abbey. Appends one
line to results.txt beside it.
"""

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import compression as bench  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

torch.manual_seed(0)
src = bench.MODELS["smollm2"][0]()
tokenizer = AutoTokenizer.from_pretrained(src)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
ratio = float(os.environ.get("XR_RATIO", "0.25"))
calib = bench.token_ids(tokenizer, "prideprejudice", 4096)
evals = {book: bench.token_ids(tokenizer, book, 4096) for book in ("emma", "northangerabbey")}
base = {book: bench.perplexity(model, ids, 1024) for book, ids in evals.items()}
row, mla = bench.run_one(model, calib, evals["emma"], 1024, "fisher", "factored", ratio, None, "sequential", 50)
if os.environ.get("XR_MLP"):  # the refined MLPs, which the conversion does not write
    from convert.compress.sequential import XR_MLP_STATES

    for layer, state in XR_MLP_STATES.items():
        mla.model.layers[layer].mlp.load_state_dict(state)
ratios = {book: bench.perplexity(mla, ids, 1024) / base[book] for book, ids in evals.items()}
switches = {k: v for k, v in os.environ.items() if k.startswith("XR_")}
line = (
    f"{switches.get('XR_TAG', '?')} emma {ratios['emma']:.4f} NA {ratios['northangerabbey']:.4f} "
    f"convert_s {row['convert_s']:.0f} switches={switches}"
)
print(line, flush=True)
with open(HERE / "results.txt", "a") as f:
    f.write(line + "\n")
