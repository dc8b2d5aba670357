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

With "profile_steps": N, the last run's prompts are decoded once more for N steps under torch's profiler
(after the timed calls, so they are not slowed by it): the operators by their own CPU time, and the
share of the decode step each takes. vLLM's engine then runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
set before vLLM is imported, so for every run of the job: "in_process" says so) for the profiler to see it.
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
    if job.get("profile_steps"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t0, "runs": [],
              "in_process": bool(job.get("profile_steps"))}  # fmt: skip
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
    if job.get("profile_steps") and job["runs"]:
        result["profile"] = profile(llm, prompts, job["profile_steps"])
    with open(out_path, "w") as f:
        json.dump(result, f)


def profile(llm, prompts, steps: int, top: int = 15) -> dict:
    """`steps` decode steps of `prompts` (already in the prefix cache) under torch's profiler, driven one
    engine step at a time: the steps that compute each prompt's uncached tail (vLLM recomputes at least
    its last position) run first, unprofiled. {"steps", "seconds" (the profiled steps, with the
    profiler's overhead), "total_ms", "ops": [{"name", "self_ms", "calls", "share"}]}: the operators by
    their own CPU time, largest first."""
    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(
        max_tokens=steps + 2, min_tokens=steps + 2, temperature=0.0, detokenize=False, ignore_eos=True
    )  # none finishes while profiled
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # every prompt's first token: its tail computed
        started |= {out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    averages = [a for a in prof.key_averages() if a.self_cpu_time_total > 0]
    total_us = sum(a.self_cpu_time_total for a in averages)
    ops = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:top]
    return {"steps": steps, "seconds": seconds, "total_ms": total_us / 1e3, "ops": [
        {"name": a.key, "self_ms": a.self_cpu_time_total / 1e3, "calls": a.count,
         "share": a.self_cpu_time_total / total_us} for a in ops]}  # fmt: skip


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(*sys.argv[1:4])
