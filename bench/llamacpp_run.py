"""One GGUF in real llama.cpp (llama-cpp-python, scripts/llamacpp_env.sh): run by bench/llamacpp.py
with the engine venv's python, one process per measurement so each starts with its own memory.

    python llamacpp_run.py speed MODEL.gguf CONTEXT DECODE THREADS IDS.json
        prompt of CONTEXT tokens (IDS repeated as needed), then DECODE greedy tokens one at a time;
        prints {"prompt_tok_s", "decode_tok_s", "decode_ms": [...]} as its last line; the KV cache's
        size is llama.cpp's own log line on stderr (`llama_kv_cache: size = ... MiB`), read by the caller.
    python llamacpp_run.py nll MODEL.gguf THREADS IDS.json
        the next-token negative log-likelihood of every token of each named sequence in IDS
        ({"name": [ids...]}), from llama.cpp's own logits; prints {"name": [nll...]}.
    python llamacpp_run.py kv MODEL.gguf CONTEXT
        a context of CONTEXT cells made and nothing evaluated: llama.cpp's log line gives the KV cache's
        size at that context without the prompt's time; prints {}.

llama.cpp's weight repacking (its "extra buffer types") is off for every file, as `--no-repack` turns it
off in llama-cli; CONVERT_LLAMACPP_REPACK=1 keeps it. On a CPU with AMX (seen on an Intel Xeon with
amx_bf16/amx_int8), llama-cpp-python 0.3.36 puts F16 weights of a deepseek2 file in its AMX buffer and
then aborts making the context (`ggml-backend.cpp:1294: GGML_ASSERT(*cur_backend_id != -1)`), before
any token; llama-arch files load either way.

Flash attention is on, as llama.cpp's own tools have it by default (`-fa auto` on the CPU) and
llama-cpp-python does not (`flash_attn=False`); CONVERT_LLAMACPP_FLASH_ATTN=0 turns it off. Without it,
llama.cpp's deepseek2 attention copies the whole latent cache into a transposed one at every step (its
`build_attn_mha`: "note: avoid this branch"), so an MLA file's decode slows with the context.
"""

import json
import os
import sys
import time

import llama_cpp
import llama_cpp.llama
import numpy as np

_model_defaults = llama_cpp.llama_model_default_params


def _without_repacking():
    """llama.cpp's default model parameters with weight repacking off (`--no-repack`)."""
    params = _model_defaults()
    params.use_extra_bufts = False
    return params


if os.environ.get("CONVERT_LLAMACPP_REPACK", "0") != "1":  # llama-cpp-python's Llama takes no such argument
    llama_cpp.llama.llama_cpp.llama_model_default_params = _without_repacking


FLASH_ATTN = os.environ.get("CONVERT_LLAMACPP_FLASH_ATTN", "1") != "0"


def _model(path: str, n_ctx: int, threads: int, logits_all: bool = False):
    return llama_cpp.Llama(
        path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
        logits_all=logits_all, flash_attn=FLASH_ATTN, verbose=True,
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
    elif command == "kv":
        _model(path, int(argv[2]), 1)
        result = {}
    else:
        result = nll(path, int(argv[2]), json.loads(open(argv[3]).read()))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
