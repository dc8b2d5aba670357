"""What attention-output refinement (`--refine-steps`) costs per layer, at a real model's shape.

One compressed layer's `MLAAttention` (random weights: the cost does not depend on them), in a Llama
decoder layer of the shape's MLP, fitted by `convert.compress.refine.refine_attention` so that the
layer's output matches a target on `--windows` calibration windows of `--window` tokens, as the
sequential calibration hands it over: seconds per Adam step of `--queries` positions (default the
device's, `REFINE_QUERIES`: 128 on a CPU, all with CUDA; the median of `--repeat` runs of 1 +
`--steps` steps less that of runs of one, side by side) and the peak bytes a one-step fit allocates
(the error evaluated on the checked windows before and after, then the step), for each layout. The
per-layer cost at the device's default steps (`REFINE_STEPS`) and for the whole model follow.

The layout `export` is the vllm/llamacpp export's attention (`convert.targets.vllm.runtime.ExportAttention`,
transformers' DeepseekV3 attention) with its latent compressed so that llama.cpp caches `--ratio` of the
GQA cache (rank = ratio·2·G·d − 64 beside the 64-dim rotary key; vLLM's 512 at most). `--queries all`
fits every position of a window, as that attention did before it took some queries against every key.

    python bench/refine_cost.py --shape llama8b --ratio 0.25 [--device cuda]
    python bench/refine_cost.py --shape qwen15b --ratio 0.5   # the 1.5B of bench/every_path.py
    python bench/refine_cost.py --shape smollm2 --ratio 0.25 --layouts export --queries all|128
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from convert.compress.refine import REFINE_QUERIES, REFINE_STEPS, Refinement, refine_attention  # noqa: E402
from convert.mla.attention import MLAAttention  # noqa: E402
from convert.mla.config import MLASection  # noqa: E402

#: Decoder shapes (hidden size D, query heads H, key/value heads G, head dim d, MLP width, layers).
SHAPES = {
    "smollm2": (576, 9, 3, 64, 1536, 30),
    "qwen15b": (1536, 12, 2, 128, 8960, 28),  # Qwen2.5(-Coder)-1.5B
    "llama8b": (4096, 32, 8, 128, 14336, 32),
}


def layer(shape: str, layout: str, ratio: float) -> MLAAttention:
    """One layer's MLA attention at `shape`, its latents `ratio` of the GQA cache (split evenly)."""
    hidden, n_heads, n_kv_heads, head_dim, _, _ = SHAPES[shape]
    rank = max(2, int(ratio * n_kv_heads * head_dim)) // 2 * 2  # each of K and V: ratio × G·d, pairs for RoPE
    freq = torch.arange(rank // 2) % (head_dim // 2)  # each key-latent pair's source frequency (absorbed)
    entry = {"rank_k": rank, "rank_v": rank, "key_freq_index": freq.tolist()}
    mla = MLASection.from_dict(
        {
            "format_version": 1,
            "converter": "bench",
            "source_architecture": "llama",
            "layout": layout,
            "latent": "split",
            "head_map": "grouped",
            "n_layers": 1,
            "hidden_size": hidden,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "softmax_scale": head_dim**-0.5,
            "causal": True,
            "layer_prefix": "model.layers.{i}.self_attn.",
            "layers": [entry],
            "rope": "rotate_half",
        }
    )
    return MLAAttention(hidden, mla, mla.layers[0], 0)


def export_layer(shape: str, ratio: float) -> torch.nn.Module:
    """The export's attention of a random one-layer Llama at `shape`, its latent sized as llama.cpp's
    `--kv-cache-ratio` sizes it (the 64 rotary dims beside it, vLLM's 512 at most)."""
    from transformers import LlamaForCausalLM

    from convert.compress.calibrate import LayerStats
    from convert.targets.vllm import ExportChoices, to_vllm_deepseek
    from convert.targets.vllm.geometry import KV_LORA_RANK
    from convert.targets.vllm.runtime import ExportAttention

    hidden, n_heads, n_kv_heads, head_dim, _, _ = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=8,  # the export's MLP is not what is measured: the decoder layer around it has its own
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
        vocab_size=16,
    )
    source = LlamaForCausalLM(config)
    rank = min(KV_LORA_RANK, round(ratio * 2 * n_kv_heads * head_dim) - 64)
    stats = [LayerStats(torch.eye(hidden, dtype=torch.float64), torch.zeros(hidden, dtype=torch.float64))]
    choices = ExportChoices(stats=stats, rank=rank, dtype=torch.float32)
    tensors, export_config = to_vllm_deepseek(source.state_dict(), source.config, choices)
    prefix = "model.layers.0.self_attn."
    own = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
    return ExportAttention(export_config, 0, own, export_config["convert_export"]["residual_scale"])


def decoder(shape: str, layout: str, ratio: float) -> torch.nn.Module:
    """A Llama decoder layer at `shape` (random weights) with `layer(shape, layout, ratio)` as its attention."""
    hidden, n_heads, n_kv_heads, head_dim, width, _ = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=width,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
    )
    with torch.device("meta"):  # the GQA attention it is built with is replaced, never allocated
        built = LlamaDecoderLayer(config, 0)
    built.self_attn = None
    built = built.to_empty(device="cpu")
    for module in built.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
        elif getattr(module, "weight", None) is not None:  # the RMS norms
            torch.nn.init.ones_(module.weight)
    built.self_attn = export_layer(shape, ratio) if layout == "export" else layer(shape, layout, ratio)
    return built


def call(shape: str, windows: int, window: int, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """(the decoder layer's keyword arguments as the sequential calibration passes them, a target)."""
    hidden, _, _, head_dim, _, _ = SHAPES[shape]
    x = torch.randn(windows, window, hidden, generator=generator)  # (B, L, D)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)  # (d/2,)
    angles = torch.arange(window)[:, None] * inv_freq[None]  # (L, d/2)
    angles = torch.cat([angles, angles], -1).expand(windows, -1, -1)  # (B, L, d)
    positions = torch.arange(window).expand(windows, -1)  # (B, L)
    kwargs = {
        "hidden_states": x,
        "position_embeddings": (angles.cos(), angles.sin()),
        "attention_mask": None,
        "position_ids": positions,
    }
    return kwargs, torch.randn(windows, window, hidden, generator=generator)


def _refine(built: torch.nn.Module, kwargs: dict, target: torch.Tensor, how: Refinement):
    """`refine_attention` of `built`'s attention within `built`, as the sequential calibration calls it."""
    return refine_attention(built.self_attn, kwargs, target, how, within=built, base=kwargs["hidden_states"])


def _run(args, layout: str, device: torch.device, steps: int, kwargs, target) -> float:
    """Seconds of one refinement of `steps` steps on a fresh layer."""
    built = decoder(args.shape, layout, args.ratio)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    _refine(built, kwargs, target, Refinement(steps=steps, queries=args.queries, device=str(device)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args, layout: str, device: torch.device) -> dict:
    """A layout's row: seconds per step (runs of 1 + `args.steps` steps less runs of one, side by
    side: the error's evaluations before and after are not steps), and a profiled one-step run's peak."""
    generator = torch.Generator().manual_seed(0)
    kwargs, target = call(args.shape, args.windows, args.window, generator)
    _run(args, layout, device, 1, kwargs, target)  # warm-up: allocator, kernels
    fixed, timed = [], []
    for _ in range(args.repeat):
        fixed.append(_run(args, layout, device, 1, kwargs, target))
        timed.append(_run(args, layout, device, 1 + args.steps, kwargs, target))
    step = (_common.median(timed) - _common.median(fixed)) / args.steps
    built = decoder(args.shape, layout, args.ratio)
    how = Refinement(steps=1, queries=args.queries, device=str(device))
    _, peak = _common.peak_allocated(_refine, built, kwargs, target, how, device=device.type)
    layers = SHAPES[args.shape][-1]
    default = REFINE_STEPS[device.type]
    return {
        "layout": layout,
        "parameters": sum(p.numel() for p in built.self_attn.parameters()),
        "step_s": step,
        "run_s": timed,
        "one_step_run_s": fixed,
        "peak_bytes": peak,
        "default_steps": default,
        "layer_s_at_default": step * (default - 1) + _common.median(fixed),
        "model_s_at_default": (step * (default - 1) + _common.median(fixed)) * layers,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--ratio", type=float, default=0.25, help="share of the GQA cache the latents keep")
    p.add_argument("--layouts", default="factored,absorbed", help="factored, absorbed, export")
    p.add_argument("--windows", type=int, default=4, help="calibration windows held (the default 4,096 tokens)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="Adam steps timed per run")
    p.add_argument("--queries", default=None, help="query positions a step (default: the device's; all: every one)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when there is one)")
    _common.add_common_args(p, "refine_cost", repeat=3)
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    given = args.queries
    args.queries = REFINE_QUERIES[device.type] if given is None else None if given == "all" else int(given)
    quiet = _common.wait_quiet(args.max_load, args.wait, args.max_busy)
    result = _common.header("refine_cost", device.type, quiet)
    result |= {"shape": args.shape, "dims": SHAPES[args.shape], "ratio": args.ratio, "windows": args.windows}
    result |= {"window": args.window, "queries": args.queries, "steps_timed": args.steps, "rows": []}
    for layout in args.layouts.split(","):
        row = measure(args, layout, device)
        result["rows"].append(row)
        print(
            f"{args.shape} {layout:8s} {args.ratio:.0%} cache, queries {args.queries or 'all'}: {row['step_s']:.3f} s/step, peak "
            f"{row['peak_bytes'] / 2**30:.2f} GiB; {row['default_steps']} steps = {row['layer_s_at_default']:.0f} s "
            f"per layer, {row['model_s_at_default'] / 60:.1f} min for {SHAPES[args.shape][-1]} layers",
            flush=True,
        )
    _common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
