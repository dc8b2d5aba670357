"""The `vllm` target: a DeepseekV3ForCausalLM in vLLM's MLA shape (kv_lora_rank 512 + 64 rotary dims).

Reference: transformers' own DeepseekV3ForCausalLM built from the exported config, with the
latent norm's eps set to the config's as vLLM reads it (`match_vllm_norms`), against the
source's own transformers model on the same ids.
"""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from convert.compress.calibrate import LayerStats
from convert.errors import ConvertError
from convert.targets.vllm import match_vllm_norms, to_vllm_deepseek

HIDDEN, LAYERS, VOCAB = 192, 2, 128


def tiny_llama(n_kv_heads: int, head_dim: int = 64, **extra) -> LlamaForCausalLM:
    torch.manual_seed(n_kv_heads)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HIDDEN // head_dim * 2 if head_dim == 64 else 4,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        intermediate_size=64,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        **extra,
    )
    return LlamaForCausalLM(config).eval()


def identity_stats() -> list[LayerStats]:
    return [LayerStats(torch.eye(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64))] * LAYERS


def exported_model(model, stats=None, **kwargs):
    tensors, config = to_vllm_deepseek(model.state_dict(), model.config, stats, **kwargs)
    export = config.pop("convert_export")
    deepseek = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(config)).eval()
    deepseek.load_state_dict(tensors, strict=True)
    match_vllm_norms(deepseek)
    return deepseek, tensors, config, export


def rel_error(model, deepseek) -> float:
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, deepseek(ids).logits
    return float((got - want).norm() / want.norm())


def test_config_and_tensor_names():
    model = tiny_llama(3)
    _, tensors, config, export = exported_model(model, identity_stats())
    assert config["model_type"] == "deepseek_v3"
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64
    assert config["q_lora_rank"] is None and config["rope_interleave"] is True
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]
    assert config["attention_bias"] is False
    names = {n.split("self_attn.")[1] for n in tensors if ".self_attn." in n}
    assert names == {
        "q_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }
    assert "lm_head.weight" in tensors  # written out although the source ties it
    assert export["kv_cache_dims_per_token_per_layer"] == 576
    assert export["gqa_cache_dims_per_token_per_layer"] == 2 * 3 * 64


def test_one_kv_head_is_exact():
    model = tiny_llama(1)
    deepseek, *_ = exported_model(model)
    assert rel_error(model, deepseek) < 1e-5


@pytest.mark.parametrize("n_kv_heads", [2, 3])
def test_proportional_key_heads_are_exact(n_kv_heads):
    """G > 1 key heads that are multiples of one another: one rotary mixture holds them all."""
    model = tiny_llama(n_kv_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.copy_(w[:64].repeat(n_kv_heads, 1) * torch.arange(1, n_kv_heads + 1).repeat_interleave(64)[:, None])
    deepseek, *_ = exported_model(model, identity_stats())
    assert rel_error(model, deepseek) < 1e-5


@pytest.mark.parametrize("n_kv_heads", [2, 3])
def test_general_key_heads_are_lossy_and_bounded(n_kv_heads):
    model = tiny_llama(n_kv_heads)
    deepseek, _, _, export = exported_model(model, identity_stats())
    err = rel_error(model, deepseek)
    assert 1e-5 < err < 0.1  # lossy (rotation of the secondary mixtures dropped), but close
    assert not export["exact"] and all(0 < e < 1 for e in export["rotary_key_energy_kept"])


@pytest.mark.parametrize(
    "make, stats, kwargs, match",
    [
        (lambda: tiny_llama(2), None, {}, "calib"),
        (lambda: tiny_llama(1), None, {"dtype": torch.float16}, "float16"),
        (lambda: tiny_llama(1, head_dim=32), None, {}, "head_dim 32"),
        (lambda: tiny_llama(1, attention_bias=True), None, {}, "attention biases"),
        (
            lambda: tiny_llama(1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            None,
            {},
            "rope_type='linear'",
        ),
    ],
)
def test_refusals(make, stats, kwargs, match):
    with pytest.raises(ConvertError, match=match):
        to_vllm_deepseek(make().state_dict(), make().config, stats, **kwargs)


def test_api_writes_a_report_that_says_where_it_is_lossy(tmp_path):
    import convert

    model = tiny_llama(3)
    model.save_pretrained(tmp_path / "src")
    calib = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
    result = convert.gqa2mla(
        tmp_path / "src", tmp_path / "out", target="vllm", calib=calib, max_ppl_ratio=1.5, tokens=64, progress=False
    )
    target = result.report["target"]
    assert target["cache_values_per_token_per_layer"] == 576 and target["gqa_cache_values_per_token_per_layer"] == 384
    assert target["cache_bytes_per_token"] == 576 * 4 * LAYERS
    assert "LOSSY" in target["note"] and "LARGER" in target["note"]
    assert "Target vllm" in (result.output / "verification.md").read_text()
    with pytest.raises(ConvertError, match="calib"):
        convert.gqa2mla(tmp_path / "src", tmp_path / "out2", target="vllm")
    assert not (tmp_path / "out2").exists()
