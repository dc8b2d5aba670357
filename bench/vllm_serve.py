"""Serve a `--target vllm` export with real vLLM (offline `vllm.LLM`): prompt log-probs and greedy tokens.

Runs in the vLLM venv (scripts/vllm_env.sh), not the project's: it imports vllm, not convert.

    V/bin/python bench/vllm_serve.py MODEL_DIR JOB.json OUT.json

JOB.json: {"prompts": [[ids...], ...], "greedy_prompt_tokens": 8, "greedy_new_tokens": 32,
"max_model_len": 2048}. OUT.json: per prompt the log-prob of each prompt token given the ones
before it (the first has none: null), and the greedy continuation of its first
greedy_prompt_tokens tokens; plus the engine's version and attention backend notes.

vLLM 0.32.0 CPU's C++ rotary kernel mishandles MLA's 3-D q_pe/k_pe views: the rotary op is
switched to its PyTorch implementation (`custom_ops: ["-rotary_embedding"]`, DESIGN §10). On a CPU
with AMX, vLLM picks its AMX_MLA backend, which takes bfloat16 or float16 weights only and stops a
float32 model while loading ("expect weight to be bfloat16, float16, ..."): CPU_MLA is asked for.
"""

import json
import os
import sys
import time


def main(model_dir: str, job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default asks for most of the RAM
    job = json.loads(open(job_path).read())
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=job.get("max_model_len", 2048),
        compilation_config={"custom_ops": ["-rotary_embedding"]},
        attention_backend="CPU_MLA",  # float32: AMX_MLA (vLLM's choice on AMX CPUs) takes 16-bit weights only
    )
    t_load = time.perf_counter() - t0
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], scoring)
    logprobs = []
    for ids, out in zip(job["prompts"], outputs):
        row = [None]
        for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
            row.append(entry[token].logprob)
        logprobs.append(row)
    n_prompt, n_new = job.get("greedy_prompt_tokens", 8), job.get("greedy_new_tokens", 32)
    greedy_params = SamplingParams(max_tokens=n_new, min_tokens=n_new, temperature=0.0, detokenize=False)
    greedy = llm.generate([TokensPrompt(prompt_token_ids=ids[:n_prompt]) for ids in job["prompts"]], greedy_params)
    result = {
        "vllm_version": vllm.__version__,
        "load_s": t_load,
        "total_s": time.perf_counter() - t0,
        "prompt_logprobs": logprobs,
        "greedy_tokens": [list(out.outputs[0].token_ids) for out in greedy],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(*sys.argv[1:4])
