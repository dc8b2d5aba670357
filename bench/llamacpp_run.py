"""One GGUF in real llama.cpp (llama-cpp-python, scripts/llamacpp_env.sh): run by bench/llamacpp.py
with the engine venv's python, one process per measurement so each starts with its own memory.

    python llamacpp_run.py speed MODEL.gguf CONTEXT DECODE THREADS IDS.json
        prompt of CONTEXT tokens (IDS repeated as needed), then DECODE greedy tokens one at a time;
        prints {"prompt_tok_s", "decode_tok_s", "decode_ms": [...]} as its last line; the KV cache's
        size is llama.cpp's own log line on stderr (`llama_kv_cache: size = ... MiB`), read by the caller.
    python llamacpp_run.py nll MODEL.gguf THREADS IDS.json
        the next-token negative log-likelihood of every token of each named sequence in IDS
        ({"name": [ids...]}), from llama.cpp's own logits; prints {"name": [nll...]}.
"""

import json
import sys
import time

import llama_cpp
import numpy as np


def _model(path: str, n_ctx: int, threads: int, logits_all: bool = False):
    return llama_cpp.Llama(
        path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
        logits_all=logits_all, verbose=True,
    )  # fmt: skip


def _last_logits(llm) -> np.ndarray:
    """The logits of the last token evaluated (vocab,): without logits_all, llama-cpp-python keeps no
    `scores` (its eval leaves them zero), so they are read from the context."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def speed(path: str, context: int, decode: int, threads: int, ids: list[int]) -> dict:
    llm = _model(path, context + decode, threads)
    prompt = (ids * (context // len(ids) + 1))[:context]
    t0 = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - t0
    steps = []
    for _ in range(decode):
        token = int(np.argmax(_last_logits(llm)))
        t0 = time.perf_counter()
        llm.eval([token])
        steps.append(time.perf_counter() - t0)
    median = float(np.median(steps))
    return {"prompt_tok_s": context / prompt_s, "decode_tok_s": 1.0 / median, "decode_ms": [s * 1e3 for s in steps]}


def nll(path: str, threads: int, sequences: dict) -> dict:
    longest = max(len(ids) for ids in sequences.values())
    llm = _model(path, longest, threads, logits_all=True)
    out = {}
    for name, ids in sequences.items():
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # (N-1, V)
        top = scores.max(-1, keepdims=True)
        log_z = np.log(np.exp(scores - top).sum(-1)) + top[:, 0]
        out[name] = (log_z - scores[np.arange(len(ids) - 1), ids[1:]]).tolist()
    return out


def main(argv: list[str]) -> None:
    command, path = argv[0], argv[1]
    if command == "speed":
        context, decode, threads = int(argv[2]), int(argv[3]), int(argv[4])
        result = speed(path, context, decode, threads, json.loads(open(argv[5]).read()))
    else:
        result = nll(path, int(argv[2]), json.loads(open(argv[3]).read()))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
