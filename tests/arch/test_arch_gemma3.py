"""Gemma 3 (text): per-head q/k norms that scale by (1 + weight), a local RoPE base for
sliding-window layers and a global one for the others, query_pre_attn_scalar, four norms per
layer, tied embeddings — converted exactly in both layouts and checked against transformers'
own Gemma 3; then the real Gemma 3 270M (fixtures/realdata.py) end to end on Austen prose."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.plan import plan_for_config

from conftest import assert_same_as_transformers, hf_model, random_ids, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
LAYOUTS = ("absorbed", "factored")


def gemma3(dtype=torch.float32, seed: int = 0):
    """A tiny random Gemma 3 (4 query heads, 2 KV heads, layers sliding/global/sliding, local base 100
    against 10,000) whose q/k norm weights (offsets from one) are not zero."""
    model = hf_model("gemma3_text", seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_((0.5 * torch.randn(param.shape, generator=generator, dtype=torch.float64)).to(dtype))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_equal_transformers(dtype, layout):
    model = gemma3(dtype)
    rope = model.config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert model.config.sliding_window < 24 and "full_attention" in model.config.layer_types
    converted = convert.to_mla(model, layout=layout)
    assert_same_as_transformers(model, converted, TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layer_rotates_with_its_own_base(layout):
    """Giving every layer the global RoPE (as a model with one rotary embedding would) moves the
    logits: the local/global split is carried, not lucky."""
    from convert.hf import layer_rotary

    model = gemma3()
    converted = convert.to_mla(model, layout=layout)
    rotary = converted.model.rotary_emb
    assert layer_rotary(rotary, converted.config, 0).keywords == {"layer_type": "sliding_attention"}
    ids = random_ids()
    with torch.no_grad():
        ref = model(ids).logits
        assert rel_err(converted(ids).logits, ref) <= TOL[torch.float32]
        global_cos_sin = converted.model.rotary_emb(
            converted.model.embed_tokens(ids), torch.arange(24)[None], "full_attention"
        )
        global_base = lambda module, args, kwargs: (args, kwargs | {"position_embeddings": global_cos_sin})
        for layer in converted.model.layers:  # every layer fed the global base's cos/sin
            layer.self_attn.register_forward_pre_hook(global_base, with_kwargs=True)
        assert rel_err(converted(ids).logits, ref) > 1e-3


def test_norm_offset_is_carried():
    model = gemma3()
    config = convert.convert_state_dict(model.state_dict(), model.config).config
    assert config["mla"]["norm_unit_offset"] is True and config["mla"]["qk_norm"] == "head"
    assert config["mla"]["softmax_scale"] == pytest.approx(24**-0.5)
    converted = convert.to_mla(model)
    for layer in converted.model.layers:
        layer.self_attn.q_norm.unit_offset = layer.self_attn.k_norm.unit_offset = False  # weight, not 1 + weight
    ids = random_ids()
    with torch.no_grad():
        assert rel_err(converted(ids).logits, model(ids).logits) > 1e-3


def test_cli_converts_verifies_and_streams(tmp_path):
    from convert.verify import verify_paths

    gemma3().save_pretrained(tmp_path / "src", safe_serialization=True)
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["greedy_match"]
    streamed = verify_paths(tmp_path / "src", tmp_path / "out", e2e="streamed", progress=False)["end_to_end"]
    assert streamed["mode"] == "streamed"
    for key in ("ppl_original", "ppl_converted", "logits_rel_error"):
        assert streamed[key] == pytest.approx(report["end_to_end"][key], rel=1e-6), key


def test_the_multimodal_model_is_refused_with_the_text_alternative():
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
    with pytest.raises(convert.ConvertError, match="vision tower.*gemma3_text"):
        plan_for_config(config)


def test_absorbed_compression_is_refused_before_any_work():
    with pytest.raises(convert.ConvertError, match="q/k norm.*layout='factored'"):
        convert.to_mla(gemma3(), kv_cache_ratio=0.5)


# ------------------------------------------------------------------ the real Gemma 3 270M


@pytest.fixture(scope="module")
def gemma3_270m():
    realdata = pytest.importorskip("realdata")
    return realdata.gemma3_dir()


@pytest.fixture(scope="module")
def gemma3_270m_converted(gemma3_270m, tmp_path_factory):
    """Gemma 3 270M converted (absorbed, the default) and verified on 256 tokens of Persuasion."""
    import realdata

    tmp = tmp_path_factory.mktemp("gemma3-270m")
    text = tmp / "persuasion.txt"
    text.write_text(realdata.austen_text("persuasion"))
    result = convert.gqa2mla(gemma3_270m, tmp / "mla", text=text, tokens=256, progress=False)
    return result, json.loads((tmp / "mla" / "verification.json").read_text())


@pytest.mark.realdata
@pytest.mark.slow
def test_real_gemma3_270m_converts_exactly_and_verifies(gemma3_270m_converted):
    result, report = gemma3_270m_converted
    mla = result.config["mla"]
    assert mla["source_architecture"] == "gemma3_text" and mla["n_layers"] == 18
    assert all(layer["rank_k"] == layer["rank_v"] == 256 for layer in mla["layers"])  # G·d = 1·256
    assert report["verdict"] == "PASS" and report["inputs"]["text"]["tokens"] == 256
    e2e = report["end_to_end"]
    assert abs(e2e["ppl_converted"] / e2e["ppl_original"] - 1) <= 1e-6, e2e
    assert e2e["top1_agreement"] == 1.0 and e2e["greedy_match"], e2e
    assert 10 < e2e["ppl_original"] < 60  # a trained model on English prose, not noise


@pytest.mark.realdata
@pytest.mark.slow
def test_real_gemma3_270m_perplexity_and_greedy_on_emma(gemma3_270m, gemma3_270m_converted):
    """1,024 tokens of Emma (windows of 512, beyond the 512-token sliding window's reach within
    a window only at its edge) and a 24-token greedy continuation, original against converted."""
    import realdata
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convert.verify.e2e import compare_models

    tokenizer = AutoTokenizer.from_pretrained(gemma3_270m)
    ids = torch.tensor(tokenizer(realdata.austen_text("emma"), add_special_tokens=False)["input_ids"][:1024])[None]
    original = AutoModelForCausalLM.from_pretrained(gemma3_270m, dtype=torch.float32).eval()
    converted = convert.load_mla_model(gemma3_270m_converted[0].output)
    figures = compare_models(original, converted, ids, window=512)
    assert abs(figures["ppl_ratio"] - 1) <= 1e-4 and figures["top1_agreement"] >= 0.999, figures
    prompt = ids[:, :16]
    kwargs = {"max_new_tokens": 24, "do_sample": False}
    assert torch.equal(converted.generate(prompt, **kwargs), original.generate(prompt, **kwargs))
