"""One checkpoint in real vLLM (CPU build, scripts/vllm_env.sh's venv), run by bench/vllm_capacity.py:
the KV cache it makes in a fixed space, then batches of concurrent sequences timed.

    V/bin/python bench/vllm_capacity_run.py MODEL_DIR JOB.json OUT.json

JOB.json: {"kv_space_gib": 4, "max_model_len": 32768, "dtype": "bfloat16", "attention_backend": null, "decode": 16,
"runs": [[concurrency, context], ...], "vocab_size": V, "seed": 0}. For each run, `concurrency`
prompts of `context` random tokens, timed by vLLM's own per-request timestamps (`RequestOutput.metrics`,
engine-core clock), in two calls:
  - the prompts, one token each: ttft_s, the median request's time to its first token; prefill_s, the
    last request's (the batch's). vLLM prefills long prompts in chunks between other requests' steps,
    so timing decode in this call would count prefill chunks as decode steps;
  - the same prompts again, 1 + `decode` tokens each: their prompts are in the prefix cache, so the batch
    starts decoding together; decode_tok_s is `concurrency` over the median request's time per step.
The cache's size is vLLM's own log line (`CPU KV cache size: N tokens`, on stdout), read by the caller.
"""

import json
import os
import random
import statistics
import sys
import time


def main(model_dir: str, job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job["kv_space_gib"])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype=job.get("dtype", "bfloat16"),
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=job["max_model_len"],
        enable_prefix_caching=True,  # the second call of each run decodes from the first call's prompts
        disable_log_stats=False,  # RequestOutput.metrics: the per-request timestamps
        compilation_config={"custom_ops": ["-rotary_embedding"]},  # vLLM 0.32 CPU's rotary bug (DESIGN §10)
        **({"attention_backend": job["attention_backend"]} if job.get("attention_backend") else {}),
    )
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t0, "runs": []}
    rng = random.Random(job.get("seed", 0))
    vocab = job["vocab_size"]
    warm = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(64)])], warm, use_tqdm=False)
    for concurrency, context in job["runs"]:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(context)])
                   for _ in range(concurrency)]  # fmt: skip
        first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        steps = job["decode"]
        more = SamplingParams(max_tokens=1 + steps, min_tokens=1 + steps, temperature=0.0, detokenize=False,
                              ignore_eos=True)  # fmt: skip
        ttft = sorted(out.metrics.first_token_latency for out in llm.generate(prompts, first, use_tqdm=False))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, more, use_tqdm=False)
        whole_s = time.perf_counter() - t0
        stats = [out.metrics for out in outs]
        step_s = [(m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) for m in stats]
        result["runs"].append({
            "concurrency": concurrency, "context": context, "ttft_s": statistics.median(ttft),
            "prefill_s": ttft[-1], "whole_s": whole_s, "step_s": statistics.median(step_s),
            "decode_tok_s": concurrency / statistics.median(step_s),
        })  # fmt: skip
        print(json.dumps(result["runs"][-1]), file=sys.stderr, flush=True)
        with open(out_path, "w") as f:
            json.dump(result, f)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(*sys.argv[1:4])
