#!/usr/bin/env python3
"""torch.compile time of SmolLM2 absorbed at 25% of the cache against the original, one tree at a
time, so that the tree before a change and after it can be run in turns (2026-12-02: the latent
RoPE and the padded output's merge as operators, `convert.mla.rope.latent_rope`,
`convert.mla.kernels.merged_value_heads`).

Each model cut to its first 4 decoder layers, train mode, a training forward (labels, 128 tokens of
Emma, use_cache=False) and its backward, compiled with Dynamo reset and a fresh Inductor cache
after an untimed warm-up compile: "compile" is the first compiled forward minus the eager one,
"first-backward" the first compiled backward (AOTAutograd compiles the backward graph there; the
eager backward takes about 0.2 s). The conversion (calibrated on 2,048 tokens of Pride and
Prejudice, as bench/train_step.py does) is pickled to CACHE on the first run and reused.

    # each tree in turn, both orders (the first model compiled in a process pays a little more):
    PYTHONPATH=/tmp/old python bench/results/compile_ops/driver.py original,absorbed-kv0.25
    python bench/results/compile_ops/driver.py absorbed-kv0.25,original

results.txt: the runs of 2026-12-02 (AMD EPYC, 2 cores, one thread), old = f526ad1, new = the change.
"""

import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
import train_step as T  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402

import convert  # noqa: E402

CACHE = Path(os.environ.get("CACHE", "/tmp/compile_ops_absorbed25.pt"))


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    original, tokenize = T.load("smollm2", torch.float32)
    models = {"original": original.eval()}
    if "absorbed-kv0.25" in names:
        if CACHE.is_file():
            models["absorbed-kv0.25"] = torch.load(CACHE, weights_only=False)
        else:
            calib = torch.tensor([tokenize(T.text("prideprejudice"))[:2048]])
            options = T.MODELS["absorbed-kv0.25"]
            models["absorbed-kv0.25"] = convert.to_mla(original, **options, calib=calib, calib_tokens=2048)
            torch.save(models["absorbed-kv0.25"], CACHE)
    ids = torch.tensor(tokenize(T.text("emma"))[:128]).view(1, 128)

    def forward(model):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    with fresh_cache():  # Inductor's one-time start-up, untimed
        torch.compile(torch.nn.Linear(8, 8))(torch.randn(4, 8)).sum().backward()
    for name in names:
        model = models[name]
        layers = model.model.layers
        model.model.layers = layers[:4]
        model.train()
        torch._dynamo.reset()
        with fresh_cache():
            eager = []
            for _ in range(3):
                t = time.perf_counter()
                forward(model)
                eager.append(time.perf_counter() - t)
            compiled = torch.compile(model)
            t = time.perf_counter()
            loss = forward(compiled)
            first = time.perf_counter() - t
            t = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - t
        model.model.layers = layers
        model.zero_grad(set_to_none=True)
        print(f"{name}: compile {first - sorted(eager)[1]:.1f}s first-backward {backward:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
