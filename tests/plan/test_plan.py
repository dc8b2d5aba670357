"""The conversion plan at real sizes, from config.json alone (meta device, no weights):
ranks, output shapes, KV-cache bytes per token and parameter counts are what the math says
(DESIGN §2–3), for the configs of models people convert."""

import resource
import time

import pytest
import torch

from convert.plan import gqa_cache_dims, plan_for_config

COMMON = {"rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False}
CONFIGS = {
    "Llama-3-8B": {
        **COMMON,
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    "Llama-3-70B": {
        **COMMON,
        "model_type": "llama",
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    "Qwen2.5-72B": {
        **COMMON,
        "model_type": "qwen2",
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
        "intermediate_size": 29568,
        "vocab_size": 152064,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 70,
    },
    "Mistral-7B": {
        **COMMON,
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    },
}
BF16 = 2  # bytes


def _geometry(config):
    hidden, heads, groups = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    return config["num_hidden_layers"], hidden, heads, groups, hidden // heads


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_exact_plan_at_real_size(name, layout):
    config = CONFIGS[name]
    n_layers, hidden, heads, groups, d = _geometry(config)
    plan_for_config(config, layout=layout)  # imports transformers' model classes once
    rss_before = _max_rss_mb()
    start = time.perf_counter()
    plan = plan_for_config(config, layout=layout)
    elapsed = time.perf_counter() - start
    # Allocating nothing: the real weights are 16–145 GB; the plan must not grow the process by 64 MB.
    assert _max_rss_mb() - rss_before < 64
    assert elapsed < 1.0, f"planning {name} took {elapsed:.2f} s"

    exact = groups * d  # r = G·d, DESIGN §2
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": exact}] * n_layers
    assert plan.dtype == torch.bfloat16
    # KV cache: an exact conversion caches as much as GQA, 2·G·d values per layer and token.
    assert gqa_cache_dims(plan.spec) == 2 * groups * d
    assert plan.cache_bytes_per_token() == (n_layers * 2 * groups * d * BF16,) * 2
    bias = name.startswith("Qwen")  # q/k/v biases
    shapes = plan.layers[0].shapes
    if layout == "absorbed":  # Ŵ^Q (H·r × D), Ŵ^O (D × H·r): r/d = G times W^Q / W^O
        expected = {
            "k_down.weight": (exact, hidden),
            "v_down.weight": (exact, hidden),
            "q_absorbed.weight": (heads * exact, hidden),
            "o_absorbed.weight": (hidden, heads * exact),
        }
        if bias:
            expected |= {"k_down.bias": (exact,), "q_absorbed.bias": (heads * exact,), "o_absorbed.bias": (hidden,)}
        per_layer = 2 * exact * hidden + 2 * heads * exact * hidden
    else:
        expected = {
            "q_proj.weight": (heads * d, hidden),
            "k_down.weight": (exact, hidden),
            "v_down.weight": (exact, hidden),
            "k_up.weight": (heads * d, exact),
            "v_up.weight": (heads * d, exact),
            "o_proj.weight": (hidden, heads * d),
        }
        if bias:  # the key bias stays exact with RoPE as an affine latent (DESIGN §5)
            expected |= {"q_proj.bias": (heads * d,), "k_down.bias": (exact,), "o_proj.bias": (hidden,)}
        per_layer = 2 * heads * d * hidden + 2 * exact * hidden + 2 * heads * d * exact
    assert shapes == expected
    bias_params = ((heads * exact if layout == "absorbed" else heads * d) + exact + hidden) if bias else 0
    assert plan.attention_params_after == n_layers * (per_layer + bias_params)
    gqa_params = n_layers * (2 * heads * d * hidden + 2 * groups * d * hidden + (heads + 2 * groups) * d * bias)
    assert plan.attention_params_before == gqa_params


def test_compressed_plan_meets_the_rank():
    config = CONFIGS["Llama-3-8B"]
    plan = plan_for_config(config, layout="factored", rank=256)
    assert {tuple(layer.ranks.values()) for layer in plan.layers} == {(256, 256)}
    assert plan.cache_dims == 32 * 512 and plan.gqa_cache_dims == 32 * 2048


def test_the_writer_layout_covers_every_tensor():
    config = CONFIGS["Mistral-7B"]
    plan = plan_for_config(config)
    out = plan.output_tensors()
    assert not plan.replaced & set(out)
    assert "model.layers.31.self_attn.q_absorbed.weight" in out and "model.embed_tokens.weight" in out
    assert out["model.embed_tokens.weight"] == ((32000, 4096), torch.bfloat16)
    # Memory of the streamed conversion: one layer at a time (its layers are large): its source
    # attention as read (bfloat16) and in float32 (a half-precision checkpoint's working
    # precision), its latent factors in float32, the absorbed products (the largest tensors)
    # in bfloat16 with the per-head up-projections they are made from, one 64 MiB block of
    # products, the writer's 64 MiB queue and the tensor it writes. Not the model, and not the
    # embedding: tensors copied through go file to file.
    hidden, heads, groups, d = 4096, 32, 8, 128
    rank = groups * d
    source = 2 * heads * d * hidden + 2 * groups * d * hidden
    factors, products, ups = 2 * rank * hidden, 2 * heads * rank * hidden, 2 * heads * d * rank
    layer = BF16 * source + 4 * (source + factors + ups) + BF16 * products
    assert plan.layer_workers() == 1
    assert plan.conversion_memory_bytes() == layer + 2 * 64 * 2**20 + heads * rank * hidden * BF16
