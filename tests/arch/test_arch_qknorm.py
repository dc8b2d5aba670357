"""q/k norm (DESIGN §5): Qwen3 (RMSNorm of q and k per head before RoPE) and OLMo 2 (over the
whole projection), converted exactly in both layouts and checked against transformers' own
implementations; what the aligned latent does not cover (absorbed or uncalibrated compression,
DeepSeek-V3 targets) is refused before any work."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.plan import gqa_cache_dims, plan_for_config

from conftest import hf_model, random_ids, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
LAYOUTS = ("absorbed", "factored")
FAMILIES = ("qwen3", "olmo2")


def qwen3(dtype=torch.float32, attention_bias: bool = False, seed: int = 0, family: str = "qwen3"):
    """A tiny random q/k-norm model (6 query heads, 2 KV heads) whose q/k norm weights are not ones."""
    model = hf_model(family, seed=seed, dtype=dtype, attention_bias=attention_bias)
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_((1 + 0.5 * torch.randn(param.shape, generator=generator, dtype=torch.float64)).to(dtype))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, dtype, layout, bias):
    model = qwen3(dtype, attention_bias=bias, family=family)
    converted = convert.to_mla(model, layout=layout)
    ids = random_ids()
    with torch.no_grad():
        ref, got = model(ids).logits, converted(ids).logits
    assert rel_err(got, ref) <= TOL[dtype]
    # the norms matter: the same weights without them give different logits
    assert any("k_norm" in name for name, _ in converted.named_parameters())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_with_a_latent_cache(family, layout):
    model = qwen3(family=family)
    converted = convert.to_mla(model, layout=layout)
    prompt = random_ids(1, 8)
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    want = model.generate(prompt, **kwargs)
    got = converted.generate(prompt, **kwargs)
    assert torch.equal(got, want)
    cache = converted(prompt, use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == 1  # one latent, not per-head keys


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_converts_and_verifies_a_directory(tmp_path, family):
    model = qwen3(attention_bias=True, family=family)
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    out = tmp_path / "mla"
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(out), "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "PASS"
    assert report["end_to_end"]["logits_rel_error"] < 1e-5
    config = json.loads((out / "config.json").read_text())
    kind = {"qwen3": "head", "olmo2": "whole"}[family]
    assert config["mla"]["qk_norm"] == kind and config["mla"]["norm_eps"] == model.config.rms_norm_eps
    again = CliRunner().invoke(main, ["verify", str(tmp_path / "src"), str(out), "-q"])
    assert again.exit_code == 0, again.output
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(out)
    ids = random_ids()
    with torch.no_grad():
        assert rel_err(auto(ids).logits, model(ids).logits) < 1e-5


def _refused(tmp_path, *args, must_name=()):
    model = qwen3()
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    before = set(os.listdir(tmp_path))
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), *map(str, args)])
    assert result.exit_code == 2, (result.output, result.exception)
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: ")
    for name in must_name:
        assert name in line, line
    assert set(os.listdir(tmp_path)) == before
    return line


def test_absorbed_compression_is_refused_before_any_work(tmp_path):
    # compression runs in the factored layout (tests/compress/test_qknorm_compression.py)
    _refused(tmp_path, "--kv-cache-ratio", 0.5, "--no-verify", must_name=["q/k norm", "--layout factored"])


def test_deepseek_targets_are_refused(tmp_path):
    _refused(tmp_path, "--target", "transformers", must_name=["--target transformers", "q/k norm"])


def test_a_missing_k_norm_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = qwen3()
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--no-verify"])
    assert result.exit_code == 2 and "model.layers.1.self_attn.k_norm.weight" in result.stderr
    assert not (tmp_path / "out").exists()


def test_other_qk_norm_families_are_refused_with_what_they_add():
    with pytest.raises(convert.ConvertError, match="mixture-of-experts"):
        convert.convert_state_dict({}, {"model_type": "qwen3_moe"})


def test_olmo2_uncalibrated_compression_is_refused(tmp_path):
    model = qwen3(family="olmo2")
    with pytest.raises(convert.ConvertError, match="olmo2 model .q/k norm.*calib"):
        convert.to_mla(model, rank=4, method="svd", layout="factored")


QWEN3 = {
    "model_type": "qwen3",
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
}
REAL = {
    "Qwen3-8B": QWEN3
    | {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "Qwen3-32B": QWEN3
    | {
        "hidden_size": 5120,
        "num_attention_heads": 64,
        "num_hidden_layers": 64,
        "intermediate_size": 25600,
        "tie_word_embeddings": False,
    },
}


REAL["OLMo-2-7B"] = {
    "model_type": "olmo2",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "vocab_size": 100352,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "head_dim": 128,
}


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_size_plans(name, layout):
    config = REAL[name]
    plan = plan_for_config(config, layout=layout)
    layers, heads, groups, d, hidden = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["hidden_size"],
    )
    exact = groups * d  # the aligned latent: every KV head's key (Qwen3: 1,024 dims; OLMo-2-7B, MHA: 4,096)
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": exact}] * layers
    assert gqa_cache_dims(plan.spec) == 2 * exact
    assert plan.cache_bytes_per_token() == (layers * 2 * exact * 2,) * 2  # bfloat16: as GQA, exactly
    shapes = plan.layers[0].shapes
    whole = config["model_type"] == "olmo2"  # its norms span the whole projections
    common = {
        "q_proj.weight": (heads * d, hidden),
        "q_norm.weight": (heads * d,) if whole else (d,),
        "k_norm.weight": (exact,) if whole else (d,),
        "k_down.weight": (exact, hidden),
        "v_down.weight": (exact, hidden),
        "k_up.weight": (heads * d, exact),
    }
    rest = {"o_absorbed.weight": (hidden, heads * exact)}
    if layout == "factored":
        rest = {"v_up.weight": (heads * d, exact), "o_proj.weight": (hidden, heads * d)}
    assert shapes == common | rest


def test_the_converted_directory_loads_in_a_fresh_process(tmp_path):
    """`import convert` registers the format: a new Python process loads it with the Auto classes."""
    model = qwen3()
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    convert.gqa2mla(tmp_path / "src", tmp_path / "mla", verify=False, progress=False)
    code = (
        "import sys, torch, convert; from transformers import AutoModelForCausalLM;"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]);"
        "print(type(m.model.layers[0].self_attn).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "mla")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MLAAttention"
