"""Exact conversion, checked against transformers' own attention modules.

For tiny random Llama / Mistral / Qwen2 models (random attention biases where the
architecture has them), every layer is converted with `convert.convert_state_dict`,
loaded into `convert.mla.MLAAttention`, and compared with the model's own
`self_attn` on the same hidden states, positions, rotary embeddings and causal
mask. Relative Frobenius error: <= 1e-5 in float32, <= 1e-10 in float64.
"""

import pytest
import torch

import convert
from convert import ConvertError

from conftest import EXACT_TOL, converted_attention, hf_inputs, hf_model, mla_attention, reference_attention, rel_err

DTYPES = [torch.float32, torch.float64]
LAYOUTS = ["absorbed", "factored"]

# (model_type, overrides): several (H, G, d, D); G = H is MHA, G = 1 is MQA.
GEOMETRIES = {
    "llama-gqa-4:2": ("llama", {}),
    "llama-mha": ("llama", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8)),
    "llama-mqa": ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1, head_dim=8)),
    # G·d = 64 > D = 32: the value latent is capped by D, the RoPE key latent is not
    "llama-wide-kv": ("llama", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=16)),
    # H·d = 64 != D = 40
    "llama-hd-ne-D": ("llama", dict(hidden_size=40, num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    "llama-bias": ("llama", dict(attention_bias=True)),
    "llama3-rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=4,
            )
        ),
    ),
    "llama-yarn-rope": (
        "llama",
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8)
        ),
    ),
    "mistral-sliding": ("mistral", {}),  # sliding_window = 5 < sequence length 12
    "mistral-mqa": ("mistral", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8)),
    "qwen2-bias": ("qwen2", {}),  # q/k/v biases
    "qwen2-mha": ("qwen2", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8)),
    "qwen2-mqa": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1, head_dim=8)),
}


def _check_all_layers(model, converted, dtype, inputs=None):
    inputs = inputs or hf_inputs(model)
    errors = []
    for layer in range(model.config.num_hidden_layers):
        ref = reference_attention(model, layer, inputs)
        out = converted_attention(converted, layer, inputs, dtype)
        assert out.dtype == dtype and out.shape == ref.shape
        errors.append(rel_err(out, ref))
    return errors


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_exact_against_transformers(geometry, layout, dtype):
    model_type, overrides = GEOMETRIES[geometry]
    model = hf_model(model_type, dtype=dtype, **overrides)
    converted = convert.convert_state_dict(model.state_dict(), model.config, layout=layout)
    mla = converted.config["mla"]
    assert mla["layout"] == layout and mla["head_map"] == "grouped" and mla["n_layers"] == 2
    assert mla["n_heads"] == model.config.num_attention_heads
    assert mla["n_kv_heads"] == model.config.num_key_value_heads
    errors = _check_all_layers(model, converted, dtype)
    assert max(errors) <= EXACT_TOL[dtype], f"relative errors per layer {errors}"


def test_biases_are_random_and_matter():
    """Guard on the guard: the bias models really have non-zero biases, and
    dropping the query bias from the converted model is caught."""
    model = hf_model("qwen2", dtype=torch.float64)
    sd = model.state_dict()
    assert float(sd["model.layers.0.self_attn.k_proj.bias"].abs().max()) > 0.1
    converted = convert.convert_state_dict(sd, model.config)
    converted["model.layers.0.self_attn.q_absorbed.bias"] = torch.zeros_like(
        converted["model.layers.0.self_attn.q_absorbed.bias"]
    )
    inputs = hf_inputs(model)
    assert (
        rel_err(converted_attention(converted, 0, inputs, torch.float64), reference_attention(model, 0, inputs)) > 1e-3
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_bias_layout_tensors(layout):
    """Llama attention_bias: q bias kept, the RoPE key bias becomes an affine latent,
    v and o biases fold into the output bias."""
    model = hf_model("llama", attention_bias=True)
    converted = convert.convert_state_dict(model.state_dict(), model.config, layout=layout)
    prefix = "model.layers.0.self_attn."
    q, o = ("q_absorbed", "o_absorbed") if layout == "absorbed" else ("q_proj", "o_proj")
    assert {f"{prefix}{q}.bias", f"{prefix}{o}.bias", f"{prefix}k_down.bias"} <= set(converted)
    assert not any(k.startswith(prefix) and k.split(".")[-2] in {"k_proj", "v_proj"} for k in converted)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_mask(layout):
    """A left-padded batch: transformers' padding+causal mask, same on both sides."""
    model = hf_model("llama")
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    inputs = hf_inputs(model, padding=padding)
    converted = convert.convert_state_dict(model.state_dict(), model.config, layout=layout)
    for layer in range(2):
        ref = reference_attention(model, layer, inputs)[:, 4:]  # positions every row attends from
        out = converted_attention(converted, layer, inputs, torch.float32)[:, 4:]
        assert rel_err(out, ref) <= EXACT_TOL[torch.float32]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_own_causal_mask_without_attention_mask(layout):
    """MLAAttention with attention_mask=None applies its own causal mask (Llama: no window)."""
    model = hf_model("llama", dtype=torch.float64)
    inputs = hf_inputs(model)
    converted = convert.convert_state_dict(model.state_dict(), model.config, layout=layout)
    module = mla_attention(converted, 1)
    with torch.no_grad():
        out = module(inputs["x"], position_embeddings=inputs["position_embeddings"], attention_mask=None)[0]
    assert rel_err(out, reference_attention(model, 1, inputs)) <= EXACT_TOL[torch.float64]


def test_converted_state_dict_keeps_other_tensors_and_describes_layers():
    model = hf_model("llama", dtype=torch.float64)
    sd = model.state_dict()
    converted = convert.convert_state_dict(sd, model.config)
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name, tensor in sd.items():
        if ".self_attn." in name and name.split(".")[-2] in attention:
            assert name not in converted
        else:
            assert torch.equal(converted[name], tensor)
    mla = converted.config["mla"]
    G, d, D = model.config.num_key_value_heads, model.config.head_dim, model.config.hidden_size
    for entry in mla["layers"]:
        assert entry["rank_k"] == G * d and entry["rank_v"] == min(G * d, D)  # exact ranks
        assert sorted(entry["key_freq_index"]) == sorted(list(range(d // 2)) * G)
    assert mla["softmax_scale"] == pytest.approx(d**-0.5)
    assert converted.config["model_type"] == "convert_mla" and mla["source_model_type"] == "llama"


def test_explicit_exact_rank_is_still_exact():
    model = hf_model("llama", dtype=torch.float64)
    G, d = model.config.num_key_value_heads, model.config.head_dim
    converted = convert.convert_state_dict(model.state_dict(), model.config, rank=G * d)
    assert max(_check_all_layers(model, converted, torch.float64)) <= EXACT_TOL[torch.float64]


def test_truncated_rank_is_lossy_and_reported():
    model = hf_model("llama", dtype=torch.float64)
    converted = convert.convert_state_dict(model.state_dict(), model.config, rank=8, method="svd")
    info = converted.layers[0]
    assert info.ranks == {"rank_k": 8, "rank_v": 8}
    assert info.retained_energy["k"] < 1.0 and info.retained_energy["v"] < 1.0
    assert min(_check_all_layers(model, converted, torch.float64)) > 1e-6


# ------------------------------------------------------------------ wrong head map


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrong_head_map_is_detected(layout):
    """A grouped (HF) model converted with the seed's tiled map runs and is wrong."""
    model = hf_model("llama", num_attention_heads=4, num_key_value_heads=2)  # true GQA
    inputs = hf_inputs(model)
    right = convert.convert_state_dict(model.state_dict(), model.config, layout=layout)
    wrong = convert.convert_state_dict(model.state_dict(), model.config, layout=layout, head_map="tiled")
    assert wrong.config["mla"]["head_map"] == "tiled"
    for layer in range(2):
        ref = reference_attention(model, layer, inputs)
        assert rel_err(converted_attention(right, layer, inputs, torch.float32), ref) <= EXACT_TOL[torch.float32]
        assert rel_err(converted_attention(wrong, layer, inputs, torch.float32), ref) > 1e-2


# ------------------------------------------------------------------ joint latent


def _seed_state_dict(D, H, G, d, n_layers=2, dtype=torch.float64, seed=0):
    from conftest import seed_gqa

    modules = [seed_gqa(D, H, G, d, seed=seed + i, dtype=dtype) for i in range(n_layers)]
    sd = {f"layers.{i}.{k}": v for i, m in enumerate(modules) for k, v in m.state_dict().items()}
    return modules, sd


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("D,H,G,d", [(24, 6, 2, 4), (16, 4, 4, 4), (8, 4, 4, 4)])
def test_joint_latent_on_seed_notation(D, H, G, d, layout, dtype):
    modules, sd = _seed_state_dict(D, H, G, d, dtype=dtype)
    converted = convert.convert_state_dict(sd, None, arch="seed", n_heads=H, latent="joint", layout=layout)
    mla = converted.config["mla"]
    assert mla["latent"] == "joint" and mla["rope"] is None
    rank = min(2 * G * d, D)  # the numerical rank of [W^K; W^V] for random weights
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    for i, ref_module in enumerate(modules):
        assert mla["layers"][i]["rank_kv"] == rank
        assert f"layers.{i}.kv_down.weight" in converted and f"layers.{i}.k_down.weight" not in converted
        with torch.no_grad():
            ref = ref_module(x, x)
            out = mla_attention(converted, i)(x, position_embeddings=None, attention_mask=None)[0]
        assert rel_err(out, ref) <= EXACT_TOL[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_joint_latent_with_rope_is_refused(layout):
    model = hf_model("llama")
    with pytest.raises(ConvertError, match="joint"):
        convert.convert_state_dict(model.state_dict(), model.config, latent="joint", layout=layout)
