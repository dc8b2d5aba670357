"""SmolLM2-135M through `--target vllm`, served by real vLLM (CPU build, its own venv).

Converts SmolLM2 with `convert gqa2mla --target vllm --calib <one Austen novel>` (the API
call), then on a held-out Austen text (another novel, never seen by the calibration):
  - transformers' DeepseekV3ForCausalLM on the export (latent-norm eps matched to vLLM's,
    `convert.targets.vllm.match_vllm_norms`) and the original LlamaForCausalLM: perplexity;
  - vLLM (`bench/vllm_serve.py`, run by the vLLM venv's python): prompt log-probs of the
    same tokens, compared with transformers' on the export (max abs diff; goal ≤ 1e-4),
    and its perplexity;
  - greedy text of the original and of vLLM; the KV cache per token in vLLM vs the original.

    python bench/vllm_target.py [--vllm-python PATH]     # default: scripts/vllm_env.sh's venv
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import convert  # noqa: E402
from convert.text import model_tokenizer, text_token_ids  # noqa: E402

SERVE = _common.BENCH / "vllm_serve.py"
GOAL_LOGPROB_DIFF, GOAL_PPL_RATIO = 1e-4, 1.05
PROMPT, NEW = 8, 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calib-book", default="prideprejudice")
    p.add_argument("--eval-book", default="emma")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("CONVERT_VLLM_PYTHON")
        or str(Path(os.environ.get("CONVERT_VLLM_VENV", Path.home() / ".cache/convert-vllm-venv")) / "bin/python"),
    )
    p.add_argument("--no-vllm", action="store_true", help="transformers figures only")
    p.add_argument("--out", default=str(_common.result_file("vllm_target", "vllm_serve_smollm2.json")))
    return p.parse_args(argv)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(token_i | tokens < i) for i ≥ 1, (N-1,) float64."""
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].double()  # (N-1, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids[:, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, PROMPT:].tolist()


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM

    from convert.targets.vllm import match_vllm_norms

    args = parse_args(argv)
    src = _common.smollm2_dir()
    calib, held_out = _common.austen_file(args.calib_book), _common.austen_file(args.eval_book)
    config = json.loads((src / "config.json").read_text())
    ids = text_token_ids(held_out, src, config["vocab_size"], args.eval_tokens)  # (1, N)
    tokenizer = model_tokenizer(src)
    work = Path(tempfile.mkdtemp(prefix="vllm-target-"))
    out = work / "smollm2-vllm"
    t0 = time.perf_counter()
    result = convert.gqa2mla(
        src, out, target="vllm", calib=calib, calib_tokens=args.calib_tokens, verify=False, progress=False
    )
    convert_s = time.perf_counter() - t0
    export = result.config["convert_export"]

    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    lp_original, greedy_original = token_logprobs(original, ids), greedy(original, ids)
    del original
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    match_vllm_norms(exported)
    lp_export, greedy_export = token_logprobs(exported, ids), greedy(exported, ids)
    del exported

    ppl = lambda lp: float((-lp.mean()).exp())
    layers = config["num_hidden_layers"]
    record = {
        "benchmark": "vllm_target",
        "command": _common.command_line(),
        "machine": _common.machine("cpu"),
        "calib": {"book": args.calib_book, "tokens": args.calib_tokens},
        "held_out": {"book": args.eval_book, "tokens": int(ids.shape[-1])},
        "convert_s": convert_s,
        "rotary_key_energy_kept": export["rotary_key_energy_kept"],
        "cache": {
            "vllm_values_per_token_per_layer": export["kv_cache_dims_per_token_per_layer"],
            "original_values_per_token_per_layer": export["gqa_cache_dims_per_token_per_layer"],
            "vllm_bytes_per_token_float32": export["kv_cache_dims_per_token_per_layer"] * 4 * layers,
            "original_bytes_per_token_float32": export["gqa_cache_dims_per_token_per_layer"] * 4 * layers,
            "vllm_bytes_per_token_bfloat16": export["kv_cache_dims_per_token_per_layer"] * 2 * layers,
        },
        "perplexity": {
            "original": ppl(lp_original),
            "transformers_deepseek_v3_export": ppl(lp_export),
            "ratio_transformers": ppl(lp_export) / ppl(lp_original),
            "goal_ratio": GOAL_PPL_RATIO,
        },
        "greedy": {
            "prompt": tokenizer.decode(ids[0, :PROMPT].tolist()),
            "original": tokenizer.decode(greedy_original),
            "transformers_export": tokenizer.decode(greedy_export),
        },
        "notes": result.notes,
    }
    if not args.no_vllm:
        job = work / "job.json"
        job.write_text(
            json.dumps({"prompts": [ids[0].tolist()], "max_model_len": ids.shape[-1] + NEW, "greedy_new_tokens": NEW})
        )
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        subprocess.run(
            [args.vllm_python, str(SERVE), str(out), str(job), str(work / "served.json")], check=True, env=env
        )
        served = json.loads((work / "served.json").read_text())
        lp_vllm = torch.tensor(served["prompt_logprobs"][0][1:], dtype=torch.float64)
        diff = float((lp_vllm - lp_export).abs().max())
        record["vllm"] = {
            "version": served["vllm_version"],
            "load_s": served["load_s"],
            "total_s": served["total_s"],
            "logprob_max_abs_diff_vs_transformers": diff,
            "goal": GOAL_LOGPROB_DIFF,
            "within_goal": diff <= GOAL_LOGPROB_DIFF,
            "greedy_identical_to_transformers": served["greedy_tokens"][0] == greedy_export,
        }
        record["perplexity"]["vllm"] = ppl(lp_vllm)
        record["perplexity"]["ratio_vllm"] = ppl(lp_vllm) / ppl(lp_original)
        record["greedy"]["vllm"] = tokenizer.decode(served["greedy_tokens"][0])
    record["perplexity"]["within_goal"] = record["perplexity"]["ratio_transformers"] <= GOAL_PPL_RATIO
    print(json.dumps({k: record[k] for k in ("perplexity", "greedy", "cache")}, indent=2))
    print(json.dumps(record.get("vllm"), indent=2))
    _common.write_json(Path(args.out), record)
    return record


if __name__ == "__main__":
    main()
