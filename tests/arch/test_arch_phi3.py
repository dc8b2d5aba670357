"""Phi-3 (model_type phi3, also Phi-3.5 and Phi-4-mini): q, k and v fused in `qkv_proj` (split on
read), gate and up fused in `gate_up_proj` (passed through), and partial RoPE where the config
has it (Phi-4-mini rotates 3/4 of each head: the rest are plain NoPE dims, exact in both layouts)."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import convert
from convert.cli import main
from convert.plan import plan_for_config

from conftest import assert_same_as_transformers, hf_model

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
LAYOUTS = ("absorbed", "factored")


def phi3(dtype=torch.float32, partial_rotary_factor: float = 0.75, seed: int = 0):
    """A tiny random Phi-3: 4 query heads, 2 KV heads of dim 16, 12 of them rotary by default."""
    return hf_model("phi3", seed=seed, dtype=dtype, partial_rotary_factor=partial_rotary_factor)


@pytest.mark.parametrize("factor", [0.75, 1.0], ids=["partial-rope", "full-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_equal_transformers(layout, dtype, factor):
    model = phi3(dtype, factor)
    converted = convert.to_mla(model, layout=layout)
    assert_same_as_transformers(model, converted, TOL[dtype])


def test_partial_rope_latent_is_rotary_pairs_then_nope_dims():
    """G·d = 32 latent dims: 12 rotary dims × 2 KV heads as 12 frequency pairs, then 2 × 4 NoPE dims."""
    config = convert.convert_state_dict(phi3().state_dict(), phi3().config).config
    mla = config["mla"]
    assert mla["rotary_dim"] == 12
    for layer in mla["layers"]:
        assert layer["rank_k"] == 32 and len(layer["key_freq_index"]) == 12
        assert sorted(set(layer["key_freq_index"])) == list(range(6))  # every rotary frequency, none beyond
    full = convert.convert_state_dict(
        phi3(partial_rotary_factor=1.0).state_dict(), phi3(partial_rotary_factor=1.0).config
    )
    assert "rotary_dim" not in full.config["mla"] and len(full.config["mla"]["layers"][0]["key_freq_index"]) == 16


def test_cli_converts_and_verifies_and_passes_the_fused_mlp_through(tmp_path):
    phi3().save_pretrained(tmp_path / "src", safe_serialization=True)
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["greedy_match"]
    source, written = (
        load_file(tmp_path / "src" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert not any("qkv_proj" in name for name in written)
    fused_mlp = [name for name in source if name.endswith("gate_up_proj.weight")]
    assert fused_mlp and all(torch.equal(written[name], source[name]) for name in fused_mlp)


def test_streamed_verification_equals_whole(tmp_path):
    from convert.verify import verify_paths

    phi3().save_pretrained(tmp_path / "src", safe_serialization=True)
    convert.gqa2mla(tmp_path / "src", tmp_path / "mla", layout="factored", verify=False, progress=False)
    whole, streamed = (
        verify_paths(tmp_path / "src", tmp_path / "mla", e2e=mode, progress=False)["end_to_end"]
        for mode in ("whole", "streamed")
    )
    for key in ("ppl_original", "ppl_converted", "logits_rel_error"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-6), key


def test_a_fused_weight_of_the_wrong_size_is_refused_naming_it(tmp_path):
    phi3().save_pretrained(tmp_path / "src", safe_serialization=True)
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()  # v's rows of one KV head missing
    save_file(tensors, path, metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and name in result.stderr and "num_key_value_heads" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_deepseek_targets_are_refused_with_the_reason(tmp_path, target):
    phi3().save_pretrained(tmp_path / "src", safe_serialization=True)
    args = ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--target", target]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "gate_up_proj" in result.stderr
    assert not (tmp_path / "out").exists()


def test_partial_rope_compresses_in_the_factored_layout_only():
    model = phi3()
    with pytest.raises(convert.ConvertError, match="partial RoPE.*layout='factored'"):
        convert.to_mla(model, rank=16, method="svd")
    compressed = convert.to_mla(model, layout="factored", rank=16, method="svd")
    assert compressed.model.layers[0].self_attn.rank_k == 16


def test_partial_rope_is_refused_for_a_family_that_rotates_every_dim():
    model = hf_model("llama")
    config = model.config.to_dict() | {"partial_rotary_factor": 0.5}
    with pytest.raises(convert.ConvertError, match="partial_rotary_factor=0.5.*llama attention does not apply"):
        convert.convert_state_dict(model.state_dict(), config)


PHI3_MINI = {  # microsoft/Phi-3-mini-4k-instruct: 32 heads, 32 KV heads (MHA), head_dim 96
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 8192,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 32000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_phi_3_mini_plan():
    plan = plan_for_config(PHI3_MINI)
    exact = 32 * 96  # G·d = 3,072 per latent: MHA keeps its cache size
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": exact}] * 32
    assert plan.cache_bytes_per_token() == (32 * 2 * exact * 2,) * 2  # bfloat16: 393,216 B
    assert plan.layers[0].shapes["q_absorbed.weight"] == (32 * exact, 3072)
    assert plan.spec.rotary_dim is None and plan.spec.softmax_scale == 96**-0.5


def test_phi_4_mini_shaped_plan_with_partial_rope():
    """Phi-4-mini's shape: 24 heads, 8 KV heads of dim 128, 96 of them rotary."""
    config = PHI3_MINI | {
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "vocab_size": 200064,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "pad_token_id": 199999,
    }
    plan = plan_for_config(config)
    assert plan.spec.rotary_dim == 96 and plan.spec.head_dim == 128
    exact = 8 * 96 + 8 * 32  # rotary pairs of the 8 KV heads + their NoPE dims = G·d = 1,024
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": 1024}] * 32
    assert plan.cache_bytes_per_token()[1] == 32 * 2 * 1024 * 2
