"""What MLA buys in real vLLM at 7-8B shapes: the tokens its KV cache holds in the same space, the
concurrency that admits, and decode speed with the cache in use, the original and the vllm export
side by side (issue 67).

For each shape (Llama-3-8B: 8 key/value heads of 128; Mistral-7B v0.3: the same attention; Qwen2.5-7B:
4 of 128, q/k/v biases), a synthetic checkpoint of `--layers` decoder layers with random weights
(capacity and speed do not depend on the weights) and `--vocab` entries (the published vocabulary's
head is 3% of a 32-layer step and would be most of a 2-layer one), exported by `convert gqa2mla
--target vllm` (no refinement, no verification: quality is not measured here), then each model in vLLM
(CPU build, `bash scripts/vllm_env.sh`) with VLLM_CPU_KVCACHE_SPACE = --kv-space-gib:
  - the tokens vLLM says its cache holds (its `KV cache size: N tokens` log line), their ratio to the
    original's beside the arithmetic limit (2·G·d / 576 values per token and layer: 3.56 at 8
    key/value heads of 128, 1.78 at 4);
  - the concurrency that admits at 8K and 32K tokens a request (cached tokens // context);
  - per --runs entry CONCURRENCYxCONTEXT: the median request's time to first token and the batch's decode
    tokens/s over --decode further steps (vLLM's per-request timestamps), and their ratios.
One line per shape and figure (`llama8b cached_tokens_ratio 3.52`, `llama8b decode_ratio_8x2048 1.10`),
a table, the JSON. Run it alone: every speed is a timing on the machine's cores.

    python bench/vllm_capacity.py [--shapes llama8b,mistral7b,qwen7b] [--layers 2] [--vocab 4096]
        [--kv-space-gib 4] [--runs 1x2048,8x2048] [--decode 32] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from memory import LLAMA3_8B, write_synthetic  # noqa: E402

RUN = _common.BENCH / "vllm_capacity_run.py"
VLLM_CACHE_VALUES = 576  # vLLM's MLA caches kv_lora_rank 512 + 64 rotary values per token and layer
CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
BACKEND_LINE = re.compile(r"Using (\w+ (?:MLA prefill |attention )?backend)")
GOAL_CACHED = 0.95  # × the arithmetic limit
GOAL_DECODE_32X8K = 1.5

#: The published configs' keys at full size (mistralai/Mistral-7B-v0.3, Qwen/Qwen2.5-7B-Instruct).
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "vocab_size": 32768,
}  # fmt: skip
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072,
    "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "vocab_size": 152064,
}  # fmt: skip
SHAPES = {"llama8b": LLAMA3_8B | {"max_position_embeddings": 131072}, "mistral7b": MISTRAL_7B, "qwen7b": QWEN25_7B}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama8b,mistral7b,qwen7b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="vLLM's dtype, both models (float32: pass --attention-backend CPU_MLA on AMX)",
    )
    p.add_argument(
        "--attention-backend", default=None, help="vLLM's attention_backend for both (default: vLLM's choice)"
    )
    p.add_argument("--runs", default="1x2048,8x2048", help="CONCURRENCYxCONTEXT batches timed ('' for none)")
    p.add_argument("--decode", type=int, default=32, help="greedy steps timed after each batch's first token")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed runs, profile this many decode steps of the last run (torch's profiler; "
                   "vLLM's engine then runs in-process for every run)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="where the synthetic checkpoints go (~1 GB a layer)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir; a rerun reuses them")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("CONVERT_VLLM_PYTHON")
        or str(Path(os.environ.get("CONVERT_VLLM_VENV", Path.home() / ".cache/convert-vllm-venv")) / "bin/python"),
    )
    p.add_argument("--out", type=Path, default=_common.result_file("vllm_capacity"))
    return p.parse_args(argv)


def arithmetic_limit(config: dict) -> float:
    """The original's cached values per token and layer (keys and values of every key/value head) over
    vLLM's 576."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_key_value_heads"] * head_dim / VLLM_CACHE_VALUES


def export(src: Path, out: Path) -> float:
    """`convert gqa2mla --target vllm` on the synthetic checkpoint (UTF-8 bytes of an Austen novel as
    calibration ids), seconds."""
    command = [sys.executable, "-m", "convert", "gqa2mla", str(src), "-o", str(out), "--target", "vllm", "--calib"]
    command += [str(_common.austen_file("prideprejudice")), "--calib-tokens", "512", "--refine-steps", "0"]
    t0 = time.perf_counter()
    subprocess.run([*command, "--no-verify", "-q"], check=True)
    return time.perf_counter() - t0


def engine(python: str, model: Path, job: dict, work: Path) -> tuple[dict, str]:
    """(vllm_capacity_run.py's JSON, its log: vLLM logs to stdout) for one model."""
    job_file, out_file = work / "job.json", work / f"{model.name}-out.json"
    job_file.write_text(json.dumps(job))
    run = subprocess.run([python, str(RUN), str(model), str(job_file), str(out_file)], capture_output=True, text=True)
    if run.returncode != 0:
        log = run.stdout + run.stderr
        causes = [line for line in log.splitlines() if "Error" in line and "Warning" not in line]
        raise RuntimeError(f"vLLM on {model.name} failed: " + "\n".join(causes[:12] or [log[-2000:]]))
    return json.loads(out_file.read_text()), run.stdout + run.stderr


def cached_tokens(log: str) -> int:
    found = CACHE_LINE.findall(log)
    if not found:
        raise RuntimeError("vLLM logged no `KV cache size: N tokens` line")
    return int(found[-1].replace(",", ""))


def measure_shape(name: str, args, python: str, work: Path) -> dict:
    config = SHAPES[name] | {"vocab_size": args.vocab, "bos_token_id": 1, "eos_token_id": 2}
    src, out = work / f"{name}-{args.layers}L-original", work / f"{name}-{args.layers}L-vllm"
    made = (out / "config.json").is_file()
    if not made:
        shutil.rmtree(out, ignore_errors=True)
        write_synthetic(src, args.layers, base=config)
    entry = {"limit": arithmetic_limit(config), "export_s": None if made else export(src, out), "models": {}}
    runs = [[int(x) for x in run.split("x")] for run in args.runs.split(",") if run]
    job = {"kv_space_gib": args.kv_space_gib, "max_model_len": args.max_model_len, "decode": args.decode,
           "runs": runs, "vocab_size": args.vocab, "dtype": args.dtype, "attention_backend": args.attention_backend,
           "profile_steps": args.profile_steps}  # fmt: skip
    for label, model in (("original", src), ("vllm", out)):
        figures, log = engine(python, model, job, work)
        figures["cached_tokens"] = cached_tokens(log)
        figures["backend"] = sorted(set(BACKEND_LINE.findall(log)))
        figures["concurrency"] = {str(c): figures["cached_tokens"] // c for c in (8192, 32768)}
        entry["models"][label] = figures
        print(f"[{name} {label}] {json.dumps(figures)}", file=sys.stderr, flush=True)
    if not args.keep:
        for path in (src, out):
            shutil.rmtree(path, ignore_errors=True)
    return entry


def lines(name: str, entry: dict) -> list[str]:
    original, mla = entry["models"]["original"], entry["models"]["vllm"]
    out = [f"{name} cached_tokens_ratio {mla['cached_tokens'] / original['cached_tokens']:.2f}",
           f"{name} cached_tokens_limit {entry['limit']:.2f}"]  # fmt: skip
    for context in ("8192", "32768"):
        out.append(f"{name} concurrency_{context} {original['concurrency'][context]} -> {mla['concurrency'][context]}")
    for base, run in zip(original["runs"], mla["runs"]):
        tag = f"{run['concurrency']}x{run['context']}"
        out.append(f"{name} decode_ratio_{tag} {run['decode_tok_s'] / base['decode_tok_s']:.2f}")
        out.append(f"{name} ttft_ratio_{tag} {run['ttft_s'] / base['ttft_s']:.2f}")
    return out


def goals(name: str, entry: dict) -> dict:
    original, mla = entry["models"]["original"], entry["models"]["vllm"]
    ratio = mla["cached_tokens"] / original["cached_tokens"]
    bound = GOAL_CACHED * entry["limit"]
    out = {f"{name}_cached": {"value": round(ratio, 3), "bound": f"≥ {bound:.2f}", "met": ratio >= bound}}
    for base, run in zip(original["runs"], mla["runs"]):
        if (run["concurrency"], run["context"]) == (32, 8192):
            value = run["decode_tok_s"] / base["decode_tok_s"]
            out[f"{name}_decode_32x8k"] = {"value": round(value, 3), "bound": f"≥ {GOAL_DECODE_32X8K}",
                                           "met": value >= GOAL_DECODE_32X8K}  # fmt: skip
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.vllm_python).is_file():
        sys.exit(f"vLLM's venv is not there ({args.vllm_python}): bash scripts/vllm_env.sh")
    quiet = _common.wait_quiet(1.0, 300)
    contention = _common.Contention()
    result = _common.header("vllm_capacity", "cpu", quiet) | {
        "layers": args.layers, "vocab": args.vocab, "kv_space_gib": args.kv_space_gib, "dtype": args.dtype,
        "decode_steps": args.decode, "shapes": {}, "lines": [], "goals": {},
    }  # fmt: skip
    if args.keep and not args.workdir:
        sys.exit("--keep needs --workdir")
    work = Path(args.workdir) if args.keep else Path(tempfile.mkdtemp(dir=args.workdir, prefix="vllm-capacity-"))
    try:
        for name in args.shapes.split(","):
            entry = measure_shape(name, args, args.vllm_python, work)
            result["shapes"][name] = entry
            result["lines"] += lines(name, entry)
            result["goals"] |= goals(name, entry)
            _common.write_json(args.out, result)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["contention"] = contention.report()
    _common.write_json(args.out, result)
    print(report_table(result["shapes"]))
    print(profile_table(result["shapes"]))
    print("\n".join(result["lines"]))
    for goal, figure in result["goals"].items():
        print(f"goal {goal}: {figure['value']} ({figure['bound']}) {'met' if figure['met'] else 'MISSED'}")
    print(_common.contention_line(result["contention"]))
    return 0


def profile_table(shapes: dict, top: int = 8) -> str:
    """Each profiled model's largest operators (own CPU time over the profiled decode steps)."""
    rows = []
    for name, entry in shapes.items():
        for label, figures in entry["models"].items():
            found = figures.get("profile")
            for op in found["ops"][:top] if found else []:
                per_step = op["self_ms"] / found["steps"]
                rows.append([name, label, op["name"], op["calls"], per_step, f"{100 * op['share']:.1f}%"])
    return _common.table(["shape", "model", "operator", "calls", "ms per step", "share"], rows) if rows else ""


def report_table(shapes: dict) -> str:
    headers = ["shape", "model", "cached tokens", "× original", "limit", "conc. @8K", "conc. @32K", "runs"]
    rows = []
    for name, entry in shapes.items():
        base = entry["models"]["original"]["cached_tokens"]
        for label, figures in entry["models"].items():
            runs = "; ".join(f"{r['concurrency']}x{r['context']}: {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s']:.1f} s"
                             for r in figures["runs"])  # fmt: skip
            rows.append([name, label, figures["cached_tokens"], figures["cached_tokens"] / base, entry["limit"],
                         figures["concurrency"]["8192"], figures["concurrency"]["32768"], runs])  # fmt: skip
    return _common.table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
