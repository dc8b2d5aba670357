#!/usr/bin/env python3
"""Peak memory of `convert gqa2mla` WITH verification, against the goal and the plan's estimate.

Cases:
  smollm2   the cached SmolLM2-135M (float32): the default (`--e2e auto` under the default memory cap:
            streamed, then greedy generation from one whole model at a time), `auto#0.9GiB`
            (--max-memory 0.9GiB: greedy generation streamed too), `auto#4GiB` (whole models),
            `auto@2#64GiB` (a machine with 2 GiB free, no cap that binds), `--e2e streamed` and `whole`
  qwen05b   a synthetic checkpoint of Qwen2.5-0.5B's published shape in float32 (random weights,
            1.98 GB): the default, --max-memory 2.5GiB and 8GiB, `--e2e streamed`
  qwen15b   the real Qwen2.5-Coder-1.5B-Instruct in bfloat16 (3.1 GB, fixtures/realdata.py): the
            default, --max-memory 6GiB, `--e2e streamed`
  llama8b   a synthetic checkpoint of Llama-3-8B's shape (random bfloat16 weights, written to
            disk as sharded safetensors); `--layers N` writes only N decoder layers so it runs
            in minutes (`--layers 32`: the whole model, 16 GB on disk, kept as `llama8b_full`);
            the full-size figures are also estimated from the same formulas; modes: the default,
            --max-memory 12GiB (greedy generation from one whole model), `auto@4#64GiB`, `--e2e streamed`

Each run is a fresh subprocess running `python -m convert gqa2mla SRC -o OUT --force -q
--e2e MODE --tokens T` (default verification dtype float64). Its peak is the child's own
`VmHWM` (/proc/self/status, read at exit); a sampling thread in the child records the peak
anonymous and file-backed RSS (RssAnon, RssFile: mmap'd checkpoint pages) every 5 ms. The
process baseline is a child that only imports torch, transformers and convert.

Goals: the default run's peak ≤ 1.5 GB (SmolLM2) and ≤ 3.5 GB (the 0.5B), and under the cap the report
states (issue 69); streamed, peak ≤ 1 GiB + 2 × (largest single layer as stored, embeddings included).
Estimate: baseline + max(conversion tensors (plan.conversion_memory_bytes), streamed
verification tensors (verify.memory.streamed_verify_memory_bytes), and under auto one whole
model for greedy generation (verify.memory.one_model_memory_bytes) when it fits in memory, or
both whole models when they do); goal: within 25% of measured. A mode `auto@G` runs `--e2e auto`
in a child that sees G GiB free (convert.verify.memory.available_memory_bytes replaced): the decision
a machine with that much free memory makes, reproducible on this one.

    python bench/memory.py [--layers 2] [--tokens 64] [--cases smollm2,qwen05b,qwen15b,llama8b]
    python bench/memory.py --cases llama8b --layers 32 --workdir /somewhere/with/50GB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

GiB = 2**30
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

#: Qwen2.5-0.5B-Instruct's published config (q/k/v biases, tied embeddings, no head_dim), in float32 as the
#: issue's user held it: 494M parameters, 1.98 GB.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "float32",
}
#: The issue's goals for the default run (peak resident memory, bytes).
DEFAULT_GOALS = {"smollm2": 1.5e9, "qwen05b": 3.5e9}

CHILD = r"""
import os, sys, threading, time, json
peak = {"anon": 0, "file": 0}
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out
def sample():
    while True:
        s = status()
        peak["anon"] = max(peak["anon"], s.get("RssAnon", 0))
        peak["file"] = max(peak["file"], s.get("RssFile", 0))
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
def report(code):
    s = status()
    with open(os.environ["MEMORY_OUT"], "w") as f:
        json.dump({"vmhwm": s["VmHWM"], "peak_anon": peak["anon"], "peak_file": peak["file"], "exit": code}, f)
code = 0
try:
    import torch, transformers, convert
    if os.environ.get("MEMORY_FREE"):  # the free memory `--e2e auto` sizes the run by
        import convert.verify.memory
        convert.verify.memory.available_memory_bytes = lambda device: int(os.environ["MEMORY_FREE"])
    if sys.argv[1:]:
        from convert.cli import main
        main(sys.argv[1:], prog_name="convert", standalone_mode=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
report(code)
sys.exit(code)
"""


def run_child(args: list[str], free: int | None = None) -> dict:
    """Peak memory of one fresh `python -m convert ARGS` process (no args: imports only); `free`:
    the bytes free that its verification sees, else the machine's."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "MEMORY_OUT": out, "PYTHONPATH": str(_common.REPO)}
    env |= {"MEMORY_FREE": str(free)} if free is not None else {}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    result["wall_s"] = wall
    if proc.returncode not in (0, 1):
        result["stderr"] = proc.stderr[-2000:]
    return result


def write_synthetic(directory: Path, layers: int, seed: int = 0, device="cpu", base: dict = LLAMA3_8B) -> dict:
    """Llama-3-8B's shape (or `base`'s) with `layers` decoder layers, random weights in `base`'s
    torch_dtype made on `device`, one shard per layer."""
    import torch
    from safetensors.torch import save_file

    from convert.hf import meta_state_dict

    config = {**base, "num_hidden_layers": layers}
    directory.mkdir(parents=True, exist_ok=True)
    state = meta_state_dict(config)
    groups: dict[str, list[str]] = {}
    for name in state:
        key = name.split(".layers.")[1].split(".")[0] if ".layers." in name else name
        groups.setdefault(key, []).append(name)
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    weight_map, files = {}, sorted(groups)
    for i, key in enumerate(files):
        filename = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for name in groups[key]:
            shape = state[name].shape
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=dtype)
            else:
                noise = torch.randn(shape, generator=generator, device=device)
                tensors[name] = (noise * 0.02).to(dtype).cpu()
            weight_map[name] = filename
        save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        del tensors
    total = sum(state[n].numel() * dtype.itemsize for n in state)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config


def sizes(config: dict) -> dict:
    """Bytes as stored of the largest decoder layer, the embedding, the largest layer overall."""

    from convert.hf import meta_state_dict
    from convert.io.reader import dtype_itemsize as itemsize

    state = meta_state_dict(config)
    size = lambda names: sum(state[n].numel() * itemsize(state[n].dtype) for n in names)
    decoder = max(size([n for n in state if f".layers.{i}." in n]) for i in range(config["num_hidden_layers"]))
    embed = max(size([n]) for n in state if "embed" in n or "lm_head" in n)
    from convert.plan import plan_for_config

    plan = plan_for_config(config)  # the exact default conversion: its layers can be larger than the source's
    grown = max(layer.params - plan._layer_source_params(i) for i, layer in enumerate(plan.layers))
    converted = decoder + max(0, grown) * itemsize(plan.dtype)
    largest = max(decoder, converted, embed)
    return {"decoder_layer": decoder, "converted_decoder_layer": converted, "embedding": embed, "largest": largest}


def _run_dtype(plan, run_dtype: str):
    """`--dtype` as the verification resolves it for this checkpoint (auto: float32 for bfloat16)."""
    from convert.options import VerifyOptions

    return VerifyOptions.from_kwargs(dtype=run_dtype).run_dtype(plan.dtype)


def estimate(config: dict, baseline: int, tokens: int, run_dtype: str = "auto") -> dict:
    """The plan's peak estimate: baseline + max(conversion, streamed verification), bytes."""
    from convert.plan import plan_for_config
    from convert.verify.memory import StoredLayers, streamed_verify_memory_bytes

    plan = plan_for_config(config)
    s = sizes(config)
    attention = max(layer.params for layer in plan.layers) * _itemsize(plan.dtype)
    layer_bytes = max(s["converted_decoder_layer"], s["decoder_layer"] + attention)
    layer_tensors = [(shape, dtype) for name, (shape, dtype) in plan.output_tensors().items() if ".layers." in name]
    tensor_bytes = max(math.prod(shape) * _itemsize(dtype) for shape, dtype in layer_tensors)  # decoder tensors
    stored = StoredLayers(layer_bytes, tensor_bytes, plan.dtype)
    verify = streamed_verify_memory_bytes(stored, config, _run_dtype(plan, run_dtype), tokens)
    conversion = plan.conversion_memory_bytes()
    return {"conversion_bytes": conversion, "verify_bytes": verify, "peak_bytes": baseline + max(conversion, verify)}


def whole_estimate(config: dict, baseline: int, tokens: int, run_dtype: str = "auto") -> int:
    """The peak of whole-model verification: both whole models and their logits."""
    from convert.plan import plan_for_config
    from convert.verify.memory import whole_model_activation_bytes, whole_model_memory_bytes

    plan = plan_for_config(config)
    models = whole_model_memory_bytes(plan.checkpoint_bytes, plan.dtype, _run_dtype(plan, run_dtype))
    return baseline + models + whole_model_activation_bytes(tokens, config["vocab_size"])


def auto_decision(
    config: dict, tokens: int, free: int, baseline: int, cap: int | None, run_dtype: str = "auto"
) -> dict:
    """What `--e2e auto` does with `free` bytes free under `cap` (--max-memory; None: the default, the
    baseline + the checkpoint + DEFAULT_CAP_EXTRA), the process at `baseline`, as the verification decides
    it (convert.verify._whole_models_fit, _one_model_fits, MemoryCap.room): "whole" when both whole models
    in the run's dtype and their logits fit in the room; else "streamed", with `greedy_bytes` (one whole
    model in greedy generation's dtype, the larger of the two) when that fits, else greedy generation
    streamed too (`greedy_bytes` None)."""
    from convert.options import VerifyOptions
    from convert.plan import plan_for_config
    from convert.verify.memory import (
        DEFAULT_CAP_EXTRA,
        free_margin_bytes,
        one_model_memory_bytes,
        whole_model_activation_bytes,
    )

    plan = plan_for_config(config)
    converted = sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in plan.output_tensors().values())
    cap = cap if cap is not None else baseline + plan.checkpoint_bytes + DEFAULT_CAP_EXTRA
    room = min(free - free_margin_bytes(free), cap - baseline)
    run = _run_dtype(plan, run_dtype)
    both = sum(one_model_memory_bytes(n, plan.dtype, run) for n in (plan.checkpoint_bytes, converted))
    if both + whole_model_activation_bytes(tokens, config["vocab_size"]) <= room:
        return {"mode": "whole", "greedy_bytes": None, "cap_bytes": cap}
    greedy_dtype = VerifyOptions(dtype=run_dtype).greedy_dtype(plan.dtype)
    model = one_model_memory_bytes(max(plan.checkpoint_bytes, converted), plan.dtype, greedy_dtype)
    return {"mode": "streamed", "greedy_bytes": model if model <= room else None, "cap_bytes": cap}


def _free_bytes() -> int:
    """The memory free on this machine, as `--e2e auto` reads it."""
    import torch

    from convert.verify.memory import available_memory_bytes

    return available_memory_bytes(torch.device("cpu"))


def _itemsize(dtype) -> int:
    from convert.io.reader import dtype_itemsize as itemsize

    return itemsize(dtype)


def case(name: str, src: Path, config: dict, tokens: int, modes: list[str], baseline: int, text: Path | None) -> dict:
    """modes: `--e2e` modes, optionally `:dtype` (the verification dtype; default auto), `@G` (auto: run
    as on a machine with G GiB free) and `#CAP` (--max-memory CAP; auto without it: the default cap)."""
    from convert.sizes import parse_size

    s = sizes(config)
    goal = GiB + 2 * s["largest"]
    rows = {}
    for run in modes:
        run_spec, _, cap_text = run.partition("#")
        spec, _, gib = run_spec.partition("@")
        mode, _, dtype = spec.partition(":")
        dtype = dtype or "auto"
        free = int(float(gib) * GiB) if gib else None
        cap = parse_size(cap_text) if cap_text else None
        est = estimate(config, baseline, tokens, dtype)
        if mode == "auto":  # whole if both fit, else streamed, then greedy generation (one whole model, or streamed)
            est |= auto_decision(config, tokens, free if free is not None else _free_bytes(), baseline, cap, dtype)
        with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
            args = ["gqa2mla", str(src), "-o", str(Path(tmp) / "out"), "--force", "-q"]
            args += ["--e2e", mode, "--tokens", str(tokens), "--dtype", dtype] + (["--text", str(text)] if text else [])
            args += ["--max-memory", cap_text] if cap_text else []
            result = run_child(args, free)
            report = Path(tmp) / "out" / "verification.json"
            if report.is_file():
                data = json.loads(report.read_text())
                e2e = data["end_to_end"] or {}
                result["verdict"] = data["verdict"]
                result["timings"] = data["timings"]
                result["memory"] = data.get("memory")
                result["greedy_skipped"] = e2e.get("greedy_skipped")
                result["greedy_how"] = e2e.get("greedy_how")
                result["greedy_match"] = e2e.get("greedy_match")
                result["e2e_mode"] = e2e.get("mode")
                result["failures"] = data["failures"]
                result["figures"] = {
                    k: e2e.get(k) for k in ("logits_rel_error", "kl_mean", "top1_agreement", "ppl_ratio")
                }
                result["max_layer_rel_error"] = max((layer["rel_error"] for layer in data["layers"]), default=None)
        result["goal_bytes"] = goal
        result["meets_goal"] = result["vmhwm"] <= goal
        if run == "auto" and name in DEFAULT_GOALS:  # issue 69: the default run's bound
            result["default_goal_bytes"] = DEFAULT_GOALS[name]
            result["meets_default_goal"] = result["vmhwm"] <= DEFAULT_GOALS[name]
        cap_bytes = (result.get("memory") or {}).get("cap_bytes")
        result["under_cap"] = None if cap_bytes is None else result["vmhwm"] <= cap_bytes
        result["estimate"] = est
        if mode == "whole" or est.get("mode") == "whole":
            result["estimate_bytes"] = whole_estimate(config, baseline, tokens, dtype)
        elif mode == "auto":
            result["estimate_bytes"] = max(est["peak_bytes"], baseline + (est["greedy_bytes"] or 0))
        else:
            result["estimate_bytes"] = est["peak_bytes"]
        result["estimate_error"] = result["estimate_bytes"] / result["vmhwm"] - 1
        rows[run] = result
        seen = f" ({gib} GiB free)" if gib else ""
        capped = f" --max-memory {cap_text}" if cap_text else ""
        under = (
            ""
            if cap_bytes is None
            else f", cap {cap_bytes / GiB:.2f} GiB ({'under' if result['under_cap'] else 'OVER'})"
        )
        print(
            f"{name} --e2e {mode} --dtype {dtype}{capped}{seen}: peak {result['vmhwm'] / GiB:.2f} GiB "
            f"({result['vmhwm'] / 1e9:.2f} GB; anon {result['peak_anon'] / GiB:.2f}, file {result['peak_file'] / GiB:.2f})"
            f"{under}, e2e {result.get('e2e_mode')}, greedy {result.get('greedy_how')}, "
            f"{result.get('verdict')}, estimate {result['estimate_bytes'] / GiB:.2f} GiB ({result['estimate_error']:+.0%}), "
            f"{result['wall_s']:.0f} s, exit {result['exit']}",
            flush=True,
        )
    return {"layers": config["num_hidden_layers"], "tokens": tokens, "sizes": s, "runs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic 8B-shape checkpoint")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cases", default="smollm2,qwen05b,qwen15b,llama8b")
    parser.add_argument("--workdir", type=Path, default=None, help="where the synthetic checkpoint is written")
    args = parser.parse_args()
    cases = args.cases.split(",")
    result = _common.header("memory", "cpu", {"loadavg": _common.load_average()})
    baseline = run_child([])["vmhwm"]
    result["baseline_bytes"] = baseline
    print(f"baseline (imports only): {baseline / GiB:.2f} GiB", flush=True)
    if "smollm2" in cases:
        src = _common.smollm2_dir()
        config = json.loads((src / "config.json").read_text())
        text = _common.austen_file("emma")
        with tempfile.TemporaryDirectory() as tmp:
            link = Path(tmp) / "smollm2"
            link.symlink_to(src)
            modes = ["auto", "auto#0.9GiB", "auto#4GiB", "auto@2#64GiB", "streamed", "whole"]
            result["smollm2"] = case("smollm2", link, config, 256, modes, baseline, text)
        save(result, cases)  # after every case: a run cut short keeps what it measured
    if "qwen05b" in cases:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            src = Path(tmp) / "qwen2.5-0.5b-shape"
            config = write_synthetic(src, QWEN25_05B["num_hidden_layers"], base=QWEN25_05B)
            modes = ["auto", "auto#2.5GiB", "auto#8GiB", "streamed"]
            result["qwen05b"] = case("qwen05b", src, config, 256, modes, baseline, None)
        save(result, cases)  # after every case: a run cut short keeps what it measured
    if "qwen15b" in cases:  # the real Qwen2.5-Coder-1.5B-Instruct, bfloat16 as published (fixtures/realdata.py)
        import realdata

        src = realdata.qwen25_coder_dir()
        config = json.loads((src / "config.json").read_text())
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            link = Path(tmp) / "qwen2.5-coder-1.5b"
            link.symlink_to(src)
            modes = ["auto", "auto#6GiB", "streamed"]
            result["qwen15b"] = case("qwen15b", link, config, 256, modes, baseline, _common.austen_file("emma"))
        save(result, cases)  # after every case: a run cut short keeps what it measured
    if "llama8b" in cases:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            src = Path(tmp) / "llama3-8b-shape"
            t0 = time.perf_counter()
            config = write_synthetic(src, args.layers)
            print(f"wrote the synthetic checkpoint ({args.layers} layers) in {time.perf_counter() - t0:.0f} s")
            key = "llama8b_full" if args.layers == LLAMA3_8B["num_hidden_layers"] else "llama8b"
            result[key] = case(
                f"llama8b[{args.layers} layers]",
                src,
                config,
                args.tokens,
                ["auto"]
                if key == "llama8b_full"
                else ["auto", "auto#12GiB", "auto@4#64GiB", "streamed", "streamed:float64"],
                baseline,
                None,
            )
        full = {**LLAMA3_8B}
        s = sizes(full)
        result["llama8b_full_estimate"] = {
            "sizes": s,
            "goal_bytes": GiB + 2 * s["largest"],
            "estimate": estimate(full, baseline, args.tokens),
            "checkpoint_bytes": sum(
                v.numel() * 2 for v in __import__("convert.hf", fromlist=["x"]).meta_state_dict(full).values()
            ),
        }
        est = result["llama8b_full_estimate"]
        print(
            f"llama8b full size (estimate): peak {est['estimate']['peak_bytes'] / GiB:.2f} GiB, "
            f"goal {est['goal_bytes'] / GiB:.2f} GiB, checkpoint {est['checkpoint_bytes'] / GiB:.1f} GiB"
        )
    save(result, cases)


def save(result: dict, cases: list[str]) -> None:
    """Write `result` into bench/results/memory/memory.json; the cases not run this time keep their last results."""
    path = _common.result_file("memory")
    if path.is_file():
        previous = json.loads(path.read_text())
        kept = ("smollm2", "qwen05b", "qwen15b", "llama8b", "llama8b_full", "llama8b_full_estimate")
        result = {**{k: v for k, v in previous.items() if k in kept}, **result}
        result["runs_of"] = {**previous.get("runs_of", {}), **{c: result["command"] for c in cases if c in result}}
    _common.write_json(path, result)


if __name__ == "__main__":
    main()
