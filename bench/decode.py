#!/usr/bin/env python3
"""Decode cost of one SmolLM2-135M attention layer: original GQA vs converted MLA.

Variants (float32, one layer, batch 1):

  gqa-eager      transformers' LlamaAttention with the eager attention
                 (repeat_kv, matmul, softmax), a DynamicCache of keys/values
  gqa-sdpa       the same module with attn_implementation="sdpa"
  mla-absorbed   convert.mla.MLAAttention, absorbed layout: MQA with head dim
                 r_K over the cached (rotated) key latent and the value latent
  mla-factored   MLAAttention, factored layout: the latent is up-projected to
                 per-head keys/values at every step, then RoPE

MLA modules come from `convert.convert_state_dict(model.state_dict(),
model.config, layout=...)`, built as tests/conftest.py does, with the model's
own rotary embedding. Each variant's DynamicCache is pre-filled to the
context length by running the module itself on the same random hidden states
(chunks of 512 tokens, positions 0..ctx-1). A timed step is one new token:
hidden state (1, 1, D), position ctx, position_embeddings from the model's
rotary_emb, attention_mask=None, on a deep copy of the pre-filled cache (made
untimed), so every step sees exactly `ctx` cached tokens. The step includes
the cache append (DynamicCache concatenates). Steps of all variants are
interleaved (order rotates each step). KV bytes per token: bytes of the
tensors the cache layer really holds (keys, values, and the factored layout's
cached positions) / ctx. The new token's output of every variant is compared
with gqa-sdpa's (relative error) as a sanity check.

    python bench/decode.py [--repeat 5] [--steps 20] [--contexts 1024 2048 4096 8192] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = ("gqa-eager", "gqa-sdpa", "mla-absorbed", "mla-factored")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "decode")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps per variant, context and repeat (default 20)"
    )
    parser.add_argument("--layer", type=int, default=0, help="which layer (default 0)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.utils import logging as hf_logging

    import convert
    from convert.errors import ConvertError
    from convert.mla import build_mla_attention, layer_tensors
    from convert.options import resolve_device

    try:
        device = resolve_device(args.device)
    except ConvertError as err:
        parser.error(str(err))
    dtype = torch.float32
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    src = C.smollm2_dir()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()
    config = model.config
    i = args.layer
    D = config.hidden_size
    rotary = model.model.rotary_emb.to(device)

    modules = {}
    for impl in ("eager", "sdpa"):
        if f"gqa-{impl}" in args.variants:
            cfg = copy.copy(config)
            cfg._attn_implementation = impl
            attn = LlamaAttention(cfg, i)
            attn.load_state_dict(model.model.layers[i].self_attn.state_dict())
            modules[f"gqa-{impl}"] = attn.to(device=device, dtype=dtype).eval()
    mla_info = {}
    for layout in ("absorbed", "factored"):
        if f"mla-{layout}" not in args.variants:
            continue
        converted = convert.convert_state_dict(model.state_dict(), config, layout=layout)
        mla = converted.config["mla"]
        module = build_mla_attention(mla, i, layer_tensors(converted, mla, i), rotary=rotary, dtype=dtype)
        modules[f"mla-{layout}"] = module.to(device)
        mla_info[layout] = {k: v for k, v in mla["layers"][i].items() if k.startswith("rank")}
        del converted
    variants = [v for v in VARIANTS if v in modules]
    params = {v: sum(p.numel() for p in m.parameters()) for v, m in modules.items()}
    del model

    gen = torch.Generator().manual_seed(0)
    max_ctx = max(args.contexts)
    hidden = torch.randn(1, max_ctx + 1, D, generator=gen).to(device, dtype)  # post-norm scale

    def step(name, cache, ctx):
        x = hidden[:, ctx : ctx + 1]
        pos = torch.tensor([[ctx]], device=device)
        pe = rotary(x, pos)
        return modules[name](x, position_embeddings=pe, attention_mask=None, past_key_values=cache, position_ids=pos)[0]

    def prefill(name, ctx):
        cache = DynamicCache(config=config)
        for start in range(0, ctx, args.prefill_chunk):
            stop = min(ctx, start + args.prefill_chunk)
            x = hidden[:, start:stop]
            pos = torch.arange(start, stop, device=device)[None]
            pe = rotary(x, pos)
            modules[name](x, position_embeddings=pe, attention_mask=None, past_key_values=cache, position_ids=pos)
        sync()
        return cache

    def cache_bytes(cache):
        layer = cache.layers[i]
        total = 0
        for t in (layer.keys, layer.values, getattr(layer, "mla_positions", None)):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    samples = {f"{ctx}:{v}": [] for ctx in args.contexts for v in variants}
    kv = {}
    check = {}
    contention = []
    with torch.no_grad():
        caches = {}
        for ctx in args.contexts:
            for v in variants:
                caches[(ctx, v)] = prefill(v, ctx)
                kv[f"{ctx}:{v}"] = {
                    "bytes": cache_bytes(caches[(ctx, v)]),
                    "per_token": cache_bytes(caches[(ctx, v)]) / ctx,
                    "keys_shape": list(caches[(ctx, v)].layers[i].keys.shape),
                    "values_shape": list(caches[(ctx, v)].layers[i].values.shape),
                }
            outs = {v: step(v, copy.deepcopy(caches[(ctx, v)]), ctx) for v in variants}
            ref = outs.get("gqa-sdpa", outs[variants[0]])
            check[ctx] = {v: float((o.double() - ref.double()).norm() / ref.double().norm()) for v, o in outs.items()}
        print(f"prefilled contexts {args.contexts} on {device}; output rel. error vs gqa-sdpa: {check}", flush=True)
        for v in variants:  # warm-up (untimed)
            for _ in range(3):
                step(v, copy.deepcopy(caches[(args.contexts[0], v)]), args.contexts[0])
        sync()

        for rep in range(args.repeat):
            watch = C.Contention()
            for ctx in args.contexts:
                for s in range(args.steps):
                    for v in C.rotate(variants, s + rep):
                        cache = copy.deepcopy(caches[(ctx, v)])
                        sync()
                        t0 = time.perf_counter()
                        step(v, cache, ctx)
                        sync()
                        samples[f"{ctx}:{v}"].append(time.perf_counter() - t0)
                        del cache
            contention.append(watch.report())
            print(
                f"repeat {rep + 1}/{args.repeat}: "
                + ", ".join(
                    f"{ctx}/{v} {C.median(samples[f'{ctx}:{v}'][-args.steps :]) * 1e3:.2f}ms"
                    for ctx in args.contexts
                    for v in variants
                )
                + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
                flush=True,
            )

    summary, rows = {}, []
    for ctx in args.contexts:
        base = C.median(samples[f"{ctx}:gqa-sdpa"]) if "gqa-sdpa" in variants else None
        base_kv = kv[f"{ctx}:gqa-sdpa"]["per_token"] if "gqa-sdpa" in variants else None
        for v in variants:
            key = f"{ctx}:{v}"
            med = C.median(samples[key])
            summary[key] = {
                "context": ctx,
                "variant": v,
                "median_step_s": med,
                "time_vs_gqa_sdpa": None if base is None else med / base,
                "kv_bytes_per_token": kv[key]["per_token"],
                "kv_vs_gqa_sdpa": None if base_kv is None else kv[key]["per_token"] / base_kv,
                "rel_error_vs_gqa_sdpa": check[ctx][v],
            }
            s = summary[key]
            rows.append(
                [
                    ctx,
                    v,
                    med * 1e3,
                    s["time_vs_gqa_sdpa"],
                    f"{kv[key]['per_token']:.0f}",
                    s["kv_vs_gqa_sdpa"],
                    check[ctx][v],
                ]
            )

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\n### Decode, one SmolLM2-135M attention layer (layer {i}), float32, batch 1, {where}; "
        f"medians of {args.repeat}×{args.steps} steps\n"
    )
    print(
        C.table(
            [
                "context",
                "variant",
                "ms / token",
                "time / gqa-sdpa",
                "KV bytes / token",
                "KV / gqa-sdpa",
                "rel. err vs gqa-sdpa",
            ],
            rows,
        )
    )
    run = whole_run.report()
    print("\n" + C.contention_line(run))

    data = C.header("decode", str(device), quiet)
    data.update(
        {
            "layer": i,
            "dtype": "float32",
            "variants": variants,
            "attention_implementations": {
                "gqa-eager": "transformers LlamaAttention, eager",
                "gqa-sdpa": "transformers LlamaAttention, sdpa",
                "mla-absorbed": "convert.mla.MLAAttention absorbed",
                "mla-factored": "convert.mla.MLAAttention factored",
            },
            "mla_ranks": mla_info,
            "parameters": params,
            "contexts": args.contexts,
            "steps": args.steps,
            "repeat": args.repeat,
            "samples_s": samples,
            "kv_cache": kv,
            "rel_error_vs_gqa_sdpa": check,
            "summary": summary,
            "contention_per_repeat": contention,
            "contention": run,
            "torch_threads": torch.get_num_threads(),
        }
    )
    C.write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
