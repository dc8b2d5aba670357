#!/usr/bin/env python3
"""Prefill and decode cost of one attention layer: original GQA vs converted MLA.

Models (`--model`):

  smollm2        layer `--layer` of the real SmolLM2-135M (H 9, G 3, d 64, D 576)
  llama8b-shape  one Llama-3-8B-shape attention layer, nothing downloaded: D 4096,
                 H 32, G 8, d 128, rope_theta 500000, random weights N(0, 1/fan_in)
                 (scores of order one: attention far from uniform); its MLP and
                 vocabulary are token-sized, they are not measured

Variants (float32, one layer, batch `--batch`):

  gqa-eager          transformers' LlamaAttention with the eager attention
                     (repeat_kv, matmul, softmax), a DynamicCache of keys/values
  gqa-sdpa           the same module with attn_implementation="sdpa"
  mla-absorbed       convert.mla.MLAAttention, absorbed layout: MQA with head dim
                     r_K over the cached (rotated) key latent and the value latent,
                     through torch's scaled_dot_product_attention
  mla-factored       MLAAttention, factored layout: the latent is up-projected to
                     per-head keys/values at every step, then RoPE, then SDPA
  mla-*-eager        the same MLA modules with `attn_impl = "eager"` (explicit
                     (B, H, L, S) scores), not run unless named in --variants

MLA modules come from `convert.convert_state_dict(model.state_dict(),
model.config, layout=...)` (exact ranks), built as tests/conftest.py does, with
the model's own rotary embedding. Prefill (timed): the module itself runs on
`ctx` random hidden states (positions 0..ctx-1, attention_mask=None: its own
causal mask) in chunks of `--prefill-chunk` tokens (default: one call), filling
a fresh DynamicCache. A timed decode step is one new token: hidden state
(B, 1, D), position ctx, position_embeddings from the model's rotary_emb,
attention_mask=None, on a deep copy of the pre-filled cache (made untimed), so
every step sees exactly `ctx` cached tokens. The step includes the cache append
(DynamicCache concatenates). Variants are interleaved (order rotates each step
and repeat). KV bytes per token: bytes of the tensors the cache layer really
holds (keys, values, and the factored layout's cached positions) / (ctx·B). The
outputs of every variant (the last prefill chunk and the new token) are compared
with gqa-sdpa's (relative error) as a sanity check.

    python bench/decode.py [--model smollm2|llama8b-shape] [--batch 1] [--repeat 5] [--steps 20]
                           [--contexts 1024 2048 4096 8192] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = ("gqa-eager", "gqa-sdpa", "mla-absorbed", "mla-factored", "mla-absorbed-eager", "mla-factored-eager")
DEFAULT_VARIANTS = {
    "smollm2": ("gqa-eager", "gqa-sdpa", "mla-absorbed", "mla-factored"),
    "llama8b-shape": ("gqa-sdpa", "mla-absorbed", "mla-factored"),
}
DEFAULT_CONTEXTS = {  # (cpu, cuda)
    "smollm2": ([1024, 2048, 4096, 8192], [1024, 2048, 4096, 8192]),
    "llama8b-shape": ([1024, 2048, 4096], [1024, 2048, 4096, 8192]),
}
# Llama-3-8B's attention (config.json of meta-llama/Meta-Llama-3-8B)
LLAMA8B_SHAPE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)


def llama8b_shape_model(max_positions: int, dtype):
    """One Llama-3-8B-shape decoder layer with random attention weights (tiny MLP and vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **LLAMA8B_SHAPE,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=max(8192, max_positions),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.model.layers[0].self_attn.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "decode")
    parser.add_argument("--model", default="smollm2", choices=sorted(DEFAULT_VARIANTS))
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument(
        "--contexts", type=int, nargs="+", help="cached tokens (default: 1k-8k; llama8b-shape on CPU 1k-4k)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps per variant, context and repeat (default 20)"
    )
    parser.add_argument("--layer", type=int, default=0, help="which layer of smollm2 (default 0)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: see the module docstring")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prefill-chunk", type=int, default=0, help="tokens per prefill call (default 0: one call)")
    args = parser.parse_args(argv)
    if args.model == "llama8b-shape" and args.out == C.result_file("decode"):
        args.out = C.result_file("decode", "decode_llama8b_shape.json")
    args.variants = args.variants or list(DEFAULT_VARIANTS[args.model])

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
    args.contexts = args.contexts or DEFAULT_CONTEXTS[args.model][cuda]
    B = args.batch

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    hf_logging.disable_progress_bar()
    max_ctx = max(args.contexts)
    if args.model == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(str(C.smollm2_dir()), dtype=dtype).eval()
        i, what = args.layer, f"one SmolLM2-135M attention layer (layer {args.layer})"
    else:
        model = llama8b_shape_model(max_ctx + 1, dtype)
        i, what = 0, "one Llama-3-8B-shape attention layer (random weights)"
    config = model.config
    D = config.hidden_size
    rotary = model.model.rotary_emb.to(device)

    modules, impl = {}, {}  # variant -> module, and MLA's attn_impl for it
    for kind in ("eager", "sdpa"):
        if f"gqa-{kind}" in args.variants:
            cfg = copy.copy(config)
            cfg._attn_implementation = kind
            attn = LlamaAttention(cfg, i)
            attn.load_state_dict(model.model.layers[i].self_attn.state_dict())
            modules[f"gqa-{kind}"] = attn.to(device=device, dtype=dtype).eval()
    mla_info = {}
    for layout in ("absorbed", "factored"):
        wanted = [v for v in (f"mla-{layout}", f"mla-{layout}-eager") if v in args.variants]
        if not wanted:
            continue
        t0 = time.perf_counter()
        converted = convert.convert_state_dict(model.state_dict(), config, layout=layout)
        mla = converted.mla
        module = build_mla_attention(mla, i, layer_tensors(converted, mla, i), rotary=rotary, dtype=dtype).to(device)
        for v in wanted:  # one module, its attention implementation set per call
            modules[v], impl[v] = module, "eager" if v.endswith("-eager") else "sdpa"
        mla_info[layout] = {k: v for k, v in mla["layers"][i].items() if k.startswith("rank")}
        print(f"converted ({layout}) in {time.perf_counter() - t0:.1f}s: {mla_info[layout]}", flush=True)
        del converted
    variants = [v for v in VARIANTS if v in modules]
    params = {v: sum(p.numel() for p in m.parameters()) for v, m in modules.items()}
    del model

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, max_ctx + 1, D, generator=gen).to(device, dtype)  # post-norm scale

    def causal_mask(name, start, stop):
        """None where the module's own causal mask is right: MLA always (bottom-right aligned),
        transformers' SDPA without cached keys (is_causal); else additive (1, 1, L, S)."""
        if name in impl or stop - start == 1 or (name == "gqa-sdpa" and start == 0):
            return None
        mask = torch.full((stop - start, stop), float("-inf"), device=device, dtype=dtype)
        return mask.triu(start + 1)[None, None]

    def run(name, start, stop, cache):
        if name in impl:
            modules[name].attn_impl = impl[name]
        x = hidden[:, start:stop]
        pos = torch.arange(start, stop, device=device)[None].expand(B, -1)
        pe, mask = rotary(x, pos), causal_mask(name, start, stop)
        return modules[name](x, position_embeddings=pe, attention_mask=mask, past_key_values=cache, position_ids=pos)[0]

    def prefill(name, ctx):
        """(cache, output of the last chunk, seconds)."""
        cache, chunk = DynamicCache(config=config), args.prefill_chunk or ctx
        sync()
        t0 = time.perf_counter()
        for start in range(0, ctx, chunk):
            out = run(name, start, min(ctx, start + chunk), cache)
        sync()
        return cache, out, time.perf_counter() - t0

    def cache_bytes(cache):
        layer = cache.layers[i]
        positions = getattr(layer, "mla_positions", None)  # the factored layout's twin layer of key positions
        tensors = (layer.keys, layer.values, None if positions is None else positions.keys)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rel(out, ref):
        return float((out.double() - ref.double()).norm() / ref.double().norm())

    samples = {f"{ctx}:{v}": [] for ctx in args.contexts for v in variants}
    prefills = {f"{ctx}:{v}": [] for ctx in args.contexts for v in variants}
    kv, check, contention = {}, {}, []
    with torch.no_grad():
        warm = min(256, max_ctx)
        for v in variants:  # warm-up (untimed)
            cache = prefill(v, warm)[0]
            for _ in range(2):
                run(v, warm, warm + 1, copy.deepcopy(cache))
        sync()
        for rep in range(args.repeat):
            watch = C.Contention()
            for ctx in args.contexts:
                caches, outs = {}, {}
                for v in C.rotate(variants, rep):
                    caches[v], out, seconds = prefill(v, ctx)
                    prefills[f"{ctx}:{v}"].append(seconds)
                    if rep == 0:
                        outs[v] = (out, run(v, ctx, ctx + 1, copy.deepcopy(caches[v])))
                        kv[f"{ctx}:{v}"] = {
                            "bytes": cache_bytes(caches[v]),
                            "per_token": cache_bytes(caches[v]) / (ctx * B),
                            "keys_shape": list(caches[v].layers[i].keys.shape),
                            "values_shape": list(caches[v].layers[i].values.shape),
                        }
                if rep == 0:
                    ref = outs.get("gqa-sdpa", outs[variants[0]])
                    check[ctx] = {
                        v: {"prefill": rel(o[0], ref[0]), "decode": rel(o[1], ref[1])} for v, o in outs.items()
                    }
                    print(f"context {ctx}: output rel. error vs gqa-sdpa {check[ctx]}", flush=True)
                for s in range(args.steps):
                    for v in C.rotate(variants, s + rep):
                        cache = copy.deepcopy(caches[v])
                        sync()
                        t0 = time.perf_counter()
                        run(v, ctx, ctx + 1, cache)
                        sync()
                        samples[f"{ctx}:{v}"].append(time.perf_counter() - t0)
                        del cache
                del caches
            contention.append(watch.report())
            print(
                f"repeat {rep + 1}/{args.repeat}: "
                + ", ".join(
                    f"{ctx}/{v} prefill {prefills[f'{ctx}:{v}'][-1]:.2f}s "
                    f"step {C.median(samples[f'{ctx}:{v}'][-args.steps :]) * 1e3:.2f}ms"
                    for ctx in args.contexts
                    for v in variants
                )
                + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
                flush=True,
            )

    summary, rows = {}, []
    for ctx in args.contexts:
        has_base = "gqa-sdpa" in variants
        base = C.median(samples[f"{ctx}:gqa-sdpa"]) if has_base else None
        base_prefill = C.median(prefills[f"{ctx}:gqa-sdpa"]) if has_base else None
        base_kv = kv[f"{ctx}:gqa-sdpa"]["per_token"] if has_base else None
        for v in variants:
            key = f"{ctx}:{v}"
            med, med_prefill = C.median(samples[key]), C.median(prefills[key])
            summary[key] = {
                "context": ctx,
                "variant": v,
                "median_prefill_s": med_prefill,
                "prefill_vs_gqa_sdpa": None if base is None else med_prefill / base_prefill,
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
                    med_prefill,
                    s["prefill_vs_gqa_sdpa"],
                    med * 1e3,
                    s["time_vs_gqa_sdpa"],
                    f"{kv[key]['per_token']:.0f}",
                    s["kv_vs_gqa_sdpa"],
                    max(check[ctx][v].values()),
                ]
            )

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    chunk = f"chunks of {args.prefill_chunk}" if args.prefill_chunk else "one call"
    print(
        f"\n### Prefill and decode, {what}, float32, batch {B}, {where}; prefill in {chunk}, "
        f"medians of {args.repeat} prefills and {args.repeat}×{args.steps} steps\n"
    )
    print(
        C.table(
            [
                "context",
                "variant",
                "prefill s",
                "prefill / gqa-sdpa",
                "ms / token",
                "time / gqa-sdpa",
                "KV bytes / token",
                "KV / gqa-sdpa",
                "rel. err vs gqa-sdpa",
            ],
            rows,
        )
    )
    run_report = whole_run.report()
    print("\n" + C.contention_line(run_report))

    data = C.header("decode", str(device), quiet)
    data.update(
        {
            "model": args.model,
            "layer": i,
            "batch": B,
            "dtype": "float32",
            "variants": variants,
            "attention_implementations": {
                "gqa-eager": "transformers LlamaAttention, eager",
                "gqa-sdpa": "transformers LlamaAttention, sdpa",
                "mla-absorbed": "convert.mla.MLAAttention absorbed, sdpa",
                "mla-factored": "convert.mla.MLAAttention factored, sdpa",
                "mla-absorbed-eager": "convert.mla.MLAAttention absorbed, eager scores",
                "mla-factored-eager": "convert.mla.MLAAttention factored, eager scores",
            },
            "mla_ranks": mla_info,
            "parameters": params,
            "contexts": args.contexts,
            "prefill_chunk": args.prefill_chunk or None,
            "steps": args.steps,
            "repeat": args.repeat,
            "prefill_samples_s": prefills,
            "samples_s": samples,
            "kv_cache": kv,
            "rel_error_vs_gqa_sdpa": check,
            "summary": summary,
            "contention_per_repeat": contention,
            "contention": run_report,
            "torch_threads": torch.get_num_threads(),
        }
    )
    C.write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
