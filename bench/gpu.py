#!/usr/bin/env python3
"""One GPU benchmark: a synthetic Llama-3-8B-shape bfloat16 checkpoint written, converted, verified on
the GPU, loaded and decoded against the original.

Stages (each writes `<out-dir>/gpu_<stage>.json` as soon as it ends, so a run cut short keeps what it
measured):

  write    the checkpoint: Llama-3-8B's shape, 32 layers, random bfloat16 generated on the device,
           one safetensors shard per layer (no download)
  convert  absorbed exact, factored exact, absorbed at 25% of the KV cache (calibrated on this
           repository's README, which has no tokenizer: UTF-8 bytes as tokens); each verified where it
           runs (`--device auto`: the GPU when there is one): the report's verdict, rule and timings
           (every second of verification), peak GPU memory
  decode   the original (transformers, SDPA) and each output (`convert.load_mla_model`) loaded on the
           device: load seconds; prefill of batch × context tokens, then decode steps at that context:
           median ms per step, and the ratio to the original's

`--small` runs the same code on a tiny Llama (2 layers) on the CPU in seconds (tests/conversion/test_gpu_bench.py).

    python bench/gpu.py [--small] [--layers 32] [--batch 4] [--context 8192] [--steps 16] [--out-dir bench/results/gpu]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import memory  # noqa: E402
from memory import LLAMA3_8B  # noqa: E402

SMALL = {
    **LLAMA3_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 512,
}
#: The conversions timed: name -> gqa2mla options.
CONVERSIONS = {
    "absorbed-exact": {"layout": "absorbed"},
    "factored-exact": {"layout": "factored"},
    "absorbed-25pct": {"layout": "absorbed", "kv_cache_ratio": 0.25, "calib_tokens": 512},
}


def write_checkpoint(directory: Path, config: dict, device) -> dict:
    """`config`'s Llama with random bfloat16 weights made on `device` (bench/memory.py's writer), one
    safetensors shard per decoder layer: its size and the seconds it took."""
    t0 = time.perf_counter()
    memory.write_synthetic(directory, config["num_hidden_layers"], device=device, base=config)
    return {
        "bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors")),
        "write_s": time.perf_counter() - t0,
    }


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def convert_all(src: Path, work: Path, device, calib: Path, tokens: int) -> dict:
    """Each of CONVERSIONS, verified on `device`: seconds, verdict, rule, the report's timings."""
    import convert

    results = {}
    for name, options in CONVERSIONS.items():
        _reset_peak(device)
        lossy = "kv_cache_ratio" in options
        extra = {"calib": calib, "text": calib, "max_ppl_ratio": 1e9} if lossy else {}  # random weights: reported
        t0 = time.perf_counter()
        result = convert.gqa2mla(
            src, work / name, device=str(device), tokens=tokens, progress=False, force=True, **options, **extra
        )
        report = result.report
        results[name] = {
            "wall_s": time.perf_counter() - t0,
            "timings": result.timings,
            "verify_timings": report["timings"],
            "verdict": report["verdict"],
            "rule": report["decision"]["rule"],
            "failures": report["failures"],
            "e2e_mode": (report["end_to_end"] or {}).get("mode"),
            "greedy_match": (report["end_to_end"] or {}).get("greedy_match"),
            "ppl_ratio": (report["end_to_end"] or {}).get("ppl_ratio"),
            "kv_cache_bytes_per_token": result.sizes.get("kv_cache_bytes_per_token_after"),
            "peak_gpu_gib": _peak_gib(device),
            "verify_device": report["device"],
        }
        print(f"convert {name}: {results[name]['verdict']} in {results[name]['wall_s']:.1f} s", flush=True)
    return results


def _decode(model, batch: int, context: int, steps: int, vocab: int, device) -> dict:
    """Prefill `batch` × `context` random tokens, then `steps` greedy decode steps: seconds."""
    import torch
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache()
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - t0
        step_s = []
        token = out.logits[:, -1:].argmax(-1)  # (B, 1)
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            step_s.append(time.perf_counter() - t0)
    return {"prefill_s": prefill, "step_ms_median": 1e3 * statistics.median(step_s), "steps": steps}


def decode_all(src: Path, work: Path, device, batch: int, context: int, steps: int) -> dict:
    """Load the original and each output on `device` in bfloat16, then `_decode` each in turn."""
    import torch
    from transformers import AutoModelForCausalLM

    import convert

    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    results = {}
    loads = {
        "original": lambda: AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map=str(device))
    }
    for name in CONVERSIONS:
        loads[name] = lambda name=name: convert.load_mla_model(work / name, device=device, dtype="bfloat16")
    for name, load in loads.items():
        _reset_peak(device)
        t0 = time.perf_counter()
        model = load().eval()
        if name == "original":
            model.config._attn_implementation = "sdpa"
        load_s = time.perf_counter() - t0
        results[name] = {"load_s": load_s, **_decode(model, batch, context, steps, vocab, device)}
        results[name]["peak_gpu_gib"] = _peak_gib(device)
        del model
        print(f"decode {name}: {results[name]}", flush=True)
    base = results["original"]
    for name in CONVERSIONS:
        results[name]["load_ratio"] = results[name]["load_s"] / base["load_s"]
        results[name]["step_ratio"] = results[name]["step_ms_median"] / base["step_ms_median"]
        results[name]["prefill_ratio"] = results[name]["prefill_s"] / base["prefill_s"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny Llama on the CPU, in seconds (the tests' run)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --small: 2)")
    parser.add_argument("--batch", type=int, default=None, help="decode batch (default 4; --small: 2)")
    parser.add_argument("--context", type=int, default=None, help="decode context (default 8192; --small: 64)")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps (default 16)")
    parser.add_argument("--tokens", type=int, default=None, help="verification tokens (default 256; --small: 64)")
    parser.add_argument("--out-dir", type=Path, default=C.RESULTS / "gpu", help="where gpu_<stage>.json go")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch for the checkpoints (default: tmp)")
    args = parser.parse_args(argv)

    import torch

    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    config = {**(SMALL if args.small else LLAMA3_8B)}
    config["num_hidden_layers"] = args.layers or config["num_hidden_layers"]
    batch, context = args.batch or (2 if args.small else 4), args.context or (64 if args.small else 8192)
    tokens = args.tokens or (64 if args.small else 256)
    head = C.header("gpu", str(device), {}) | {"config": config, "batch": batch, "context": context}
    if device.type == "cuda":
        head["gpu"] = torch.cuda.get_device_name(device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert-bench-gpu-", dir=args.workdir))
    try:
        src = work / "llama3-8b-shape"
        C.write_json(args.out_dir / "gpu_write.json", head | write_checkpoint(src, config, device))
        calib = C.REPO / "README.md"
        converted = convert_all(src, work, device, calib, tokens)
        C.write_json(args.out_dir / "gpu_convert.json", head | {"conversions": converted})
        decoded = decode_all(src, work, device, batch, context, args.steps)
        C.write_json(args.out_dir / "gpu_decode.json", head | {"decode": decoded})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [n, r["verdict"], r["wall_s"], r["verify_timings"]["total_s"], r["peak_gpu_gib"]] for n, r in converted.items()
    ]
    print("\n" + C.table(["conversion", "verdict", "convert+verify s", "verify s", "peak GPU GiB"], rows))
    rows = [
        [n, r["load_s"], r.get("load_ratio"), r["prefill_s"], r["step_ms_median"], r.get("step_ratio")]
        for n, r in decoded.items()
    ]
    print("\n" + C.table(["model", "load s", "× original", "prefill s", "ms / step", "× original"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
