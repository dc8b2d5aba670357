"""Phase timing of a SmolLM2 factored conversion at a share (default 25%) with the package's defaults,
and with --ppl its one-shot perplexity ratio on Northanger Abbey (as bench/compression.py judges).

    python bench/results/refine_reuse/driver.py 0.25 --ppl
"""

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/

import compression as bench  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import convert  # noqa: E402
import convert.targets.mla as mla  # noqa: E402
from convert.compress import sequential  # noqa: E402

SECONDS = collections.defaultdict(float)


def timed(owner, name: str, key: str) -> None:
    """Add the wall time of every call of `owner.name` to SECONDS[key]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


timed(mla.compress, "fisher_calibrate_streamed", "fisher")
timed(sequential.SequentialCalibration, "stats", "seq.stats")
timed(sequential.SequentialCalibration, "_refine", "refine")
timed(sequential.SequentialCalibration, "advance", "advance(total incl refine)")
timed(sequential.SequentialCalibration, "__init__", "seq.init")
timed(mla, "convert_layer", "convert_layer")
timed(mla, "layer_weighting", "layer_weighting")
timed(mla, "output_config", "output_config")

src = bench.MODELS["smollm2"][0]()
tokenizer = AutoTokenizer.from_pretrained(src)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
calib = bench.token_ids(tokenizer, "prideprejudice", convert.ConvertOptions.calib_tokens)
ratio = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
t0 = time.perf_counter()
state = convert.convert_state_dict(
    model.state_dict(), model.config, layout="factored", kv_cache_ratio=ratio, method="fisher", calib=calib
)
print(f"total {time.perf_counter() - t0:.1f}")
for key, seconds in SECONDS.items():
    print(f"{key:30s} {seconds:8.1f}")
if "--ppl" in sys.argv:
    eval_ids = bench.token_ids(tokenizer, "northangerabbey", 4096)
    base = bench.perplexity(model, eval_ids, 1024)
    converted = bench.build_mla_model(state.config, dict(state), torch.float32)
    print("ratio", bench.perplexity(converted, eval_ids, 1024) / base)
