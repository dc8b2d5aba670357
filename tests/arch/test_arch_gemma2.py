"""Gemma 2: scores scaled by query_pre_attn_scalar^-1/2 and soft-capped, alternating sliding-window
layers, four norms per layer, tied embeddings — converted exactly in both layouts and checked
against transformers' own Gemma 2.

transformers implements soft-capping only in its eager attention (SDPA refuses `softcap`), whose
softmax runs in float32 even for float64 inputs: the float64 reference is float32-accurate, so
float64 runs are held to the float32 bound here (the converted model keeps float64 throughout).
"""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.plan import plan_for_config

from conftest import assert_same_as_transformers, hf_model, random_ids, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-5}  # see the module docstring for float64


def gemma2(dtype=torch.float32, **overrides):
    model = hf_model("gemma2", dtype=dtype, **overrides)
    model.config._attn_implementation = "eager"  # the only implementation with soft-capping
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_logits_and_greedy_equal_transformers(dtype, layout):
    model = gemma2(dtype)
    assert model.config.sliding_window < 24 and model.config.attn_logit_softcapping == 5.0
    converted = convert.to_mla(model, layout=layout)
    assert_same_as_transformers(model, converted, TOL[dtype])


def test_the_soft_cap_and_scale_are_carried():
    model = gemma2()
    config = convert.convert_state_dict(model.state_dict(), model.config).config
    assert config["mla"]["softcap"] == 5.0 and config["mla"]["softmax_scale"] == pytest.approx(24**-0.5)
    uncapped = convert.to_mla(model)
    for layer in uncapped.model.layers:
        layer.self_attn.softcap = None  # without the cap the logits move: the test above can fail
    ids = random_ids()
    with torch.no_grad():
        assert rel_err(uncapped(ids).logits, model(ids).logits) > 1e-3


def test_cli_converts_and_verifies(tmp_path):
    gemma2().save_pretrained(tmp_path / "src", safe_serialization=True)
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["greedy_match"]


def test_bidirectional_is_refused():
    model = gemma2()
    model.config.use_bidirectional_attention = True
    with pytest.raises(convert.ConvertError, match="use_bidirectional_attention"):
        convert.to_mla(model)


def test_gemma_2_9b_plan():
    config = {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "num_hidden_layers": 42,
        "intermediate_size": 14336,
        "vocab_size": 256000,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    plan = plan_for_config(config)
    exact = 8 * 256  # G·d = 2,048 per latent
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": exact}] * 42
    assert plan.cache_bytes_per_token() == (42 * 2 * exact * 2,) * 2  # bfloat16, as GQA
    assert plan.spec.softcap == 50.0 and plan.spec.softmax_scale == 256**-0.5
    assert plan.layers[0].shapes["q_absorbed.weight"] == (16 * exact, 3584)


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "qwen3"])
def test_streamed_verification_equals_whole(tmp_path, family):
    """The layer-streamed end-to-end check does what each family's model forward does around its
    layers (Gemma: embeddings × √D and the final logit soft-cap; OLMo 2: post-norm)."""
    from convert.verify import verify_paths

    (gemma2() if family == "gemma2" else hf_model(family)).save_pretrained(tmp_path / "src", safe_serialization=True)
    convert.gqa2mla(tmp_path / "src", tmp_path / "mla", verify=False, progress=False)
    figures = {
        mode: verify_paths(tmp_path / "src", tmp_path / "mla", e2e=mode, progress=False)["end_to_end"]
        for mode in ("whole", "streamed")
    }
    whole, streamed = figures["whole"], figures["streamed"]
    assert streamed["mode"] == "streamed" and whole["mode"] == "whole"
    for key in ("ppl_original", "ppl_converted", "logits_rel_error"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-6), key
    assert streamed["top1_agreement"] == whole["top1_agreement"]
