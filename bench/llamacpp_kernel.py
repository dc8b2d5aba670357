#!/usr/bin/env python3
"""llama.cpp's CPU flash-attention kernel at decode, by MLA head size: why a deepseek2 file's
decode speed does not follow its cache size.

In llama.cpp's deepseek2 path each cached row is `kv_lora_rank + n_rot` values (the key) and the
value is a view of its first `kv_lora_rank`; a decode step is one `ggml_flash_attn_ext` per layer
over the whole cache. ggml's CPU kernel vectorises the key dot product (`ggml_vec_dot_f16`) and the
value update (`ggml_vec_mad_f16`) in blocks (vec.cpp, vec.h: `n & ~(STEP - 1)`) and runs what is
left one value at a time, converting half to single precision and back. The blocks depend on how
ggml was compiled (AVX512-FP16: 64 for the dot, 128 for the update; plain AVX-512: 64; AVX2: 32).

This compiles a small C program against the engine's own ggml (`scripts/llamacpp_env.sh`'s venv,
its headers and libraries) that times one decode call: a float32 query of `--heads` heads against a
float16 cache of `--context` rows of K values, V a view of the first V of each row, as deepseek2
builds it. The shapes are each `kv_lora_rank` (K = rank + n_rot, V = rank), interleaved within each
repeat, medians quoted, with the values the blocks leave over per row for this machine's build.

    python bench/llamacpp_kernel.py [--ranks 32,64,...] [--n-rot 64] [--context 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import cpuinfo_field, header, median, table, wait_quiet, write_json  # noqa: E402

from convert.targets.llamacpp.engine import engine_python  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

PROBE_C = r"""
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {  /* DK DV context heads threads calls */
    int dk = atoi(argv[1]), dv = atoi(argv[2]), n_kv = atoi(argv[3]), heads = atoi(argv[4]);
    int threads = atoi(argv[5]), calls = atoi(argv[6]);
    struct ggml_init_params params = {(size_t)1 << 30, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, dk, 1, heads, 1);  /* one token */
    struct ggml_tensor *k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, dk, n_kv, 1, 1);   /* the latent cache */
    struct ggml_tensor *v = ggml_view_4d(ctx, k, dv, n_kv, 1, 1, k->nb[1], k->nb[2], k->nb[3], 0);
    struct ggml_tensor *mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, 1, 1, 1);
    srand(0);
    for (long i = 0; i < (long)dk * heads; i++) ((float *)q->data)[i] = ((rand() % 1000) - 500) * 1e-3f;
    for (long i = 0; i < (long)dk * n_kv; i++)
        ((ggml_fp16_t *)k->data)[i] = ggml_fp32_to_fp16(((rand() % 1000) - 500) * 1e-3f);
    for (long i = 0; i < n_kv; i++) ((ggml_fp16_t *)mask->data)[i] = ggml_fp32_to_fp16(0.0f);
    struct ggml_tensor *out = ggml_flash_attn_ext(ctx, q, k, v, mask, 0.125f, 0.0f, 0.0f);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    ggml_graph_compute_with_ctx(ctx, graph, threads);  /* warm-up */
    double start = now();
    for (int c = 0; c < calls; c++) ggml_graph_compute_with_ctx(ctx, graph, threads);
    printf("%.6f\n", (now() - start) / calls * 1e3);
    return 0;
}
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="32,64,96,128,192,256,320,384", help="kv_lora_rank values, comma-separated")
    p.add_argument("--n-rot", type=int, default=64, help="the rotary key's width (SmolLM2: 64)")
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9)")
    p.add_argument("--context", type=int, default=8192, help="cached tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20, help="calls timed per sample")
    p.add_argument("--repeat", type=int, default=5, help="samples per shape, the shapes interleaved")
    p.add_argument("--max-load", type=float, default=0.5, help="wait for a quiet machine (1-min load average)")
    p.add_argument("--wait", type=float, default=120.0, help="give up waiting after this many seconds")
    p.add_argument("--out", type=Path, default=RESULTS / "llamacpp_kernel" / "llamacpp_kernel.json")
    return p.parse_args(argv)


def build_probe(work: Path) -> Path:
    """The probe, compiled and linked against the engine venv's ggml."""
    python = engine_python()
    if python is None:
        sys.exit("no llama.cpp engine: bash scripts/llamacpp_env.sh")
    site = next(python.parent.parent.glob("lib/python*/site-packages"))
    include, lib = site / "include", site / "llama_cpp" / "lib"
    if not (include / "ggml-cpu.h").is_file() or shutil.which("cc") is None:
        sys.exit(f"needs a C compiler (cc) and ggml's headers in {include}")
    (work / "probe.c").write_text(PROBE_C)
    exe = work / "probe"
    cmd = ["cc", "-O2", f"-I{include}", str(work / "probe.c"), f"-L{lib}", "-lggml", "-lggml-base", "-lggml-cpu"]
    subprocess.run([*cmd, f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
    return exe


def blocks(flags: set[str]) -> tuple[int, int]:
    """(dot block, update block) of ggml's f16 vector code as llama-cpp-python's build picks it for this
    CPU (GGML_NATIVE): simd-mappings.h's GGML_F32_STEP and GGML_F16_STEP."""
    if "avx512_fp16" in flags:
        return 64, 128
    if "avx512f" in flags:
        return 64, 64
    return 32, 32


def main(argv=None) -> None:
    args = parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    shapes = [(r + args.n_rot, r) for r in ranks]
    dot_block, update_block = blocks(set(cpuinfo_field("flags").split()))
    quiet = wait_quiet(args.max_load, args.wait)
    samples: dict[int, list[float]] = {r: [] for r in ranks}
    with tempfile.TemporaryDirectory() as tmp:
        probe = build_probe(Path(tmp))
        for _ in range(args.repeat):
            for rank, (dk, dv) in zip(ranks, shapes):
                argv_ = [str(probe), str(dk), str(dv), str(args.context), str(args.heads), str(args.threads)]
                out = subprocess.run([*argv_, str(args.calls)], check=True, capture_output=True, text=True)
                samples[rank].append(float(out.stdout.strip()))
    rows, records = [], []
    for rank, (dk, dv) in zip(ranks, shapes):
        ms = median(samples[rank])
        left = (dk % dot_block, dv % update_block)
        row_kib = (dk * 2) / 1024  # one layer's cached row in float16
        records.append(
            {"kv_lora_rank": rank, "dk": dk, "dv": dv, "ms_per_call": ms, "samples": samples[rank],
             "scalar_values_dot": left[0], "scalar_values_update": left[1], "row_kib": row_kib}
        )  # fmt: skip
        rows.append([rank, f"{dk} / {dv}", f"{row_kib:.3f}", f"{left[0]} / {left[1]}", f"{ms:.2f}"])
    fastest = min(r["ms_per_call"] for r in records)
    for row, rec in zip(rows, records):
        row.append(f"{rec['ms_per_call'] / fastest:.2f}")
    result = header("llamacpp_kernel", "cpu", quiet)
    result.update(
        context=args.context, heads=args.heads, threads=args.threads, calls=args.calls, repeat=args.repeat,
        blocks={"dot": dot_block, "update": update_block}, shapes=records,
    )  # fmt: skip
    write_json(args.out, result)
    heads = ["kv_lora_rank", "K / V per row", "row KiB (f16)", "values left to scalar code (dot / update)",
             f"ms per decode call ({args.context} rows)", "x the fastest"]  # fmt: skip
    print(table(heads, rows))
    print(f"blocks on this CPU's build: dot {dot_block}, update {update_block}; wrote {args.out}")


if __name__ == "__main__":
    main()
