"""Mixtral: Mistral's attention converted exactly, the mixture-of-experts MLP (router and experts)
passed through. Checkpoints on disk keep one weight per expert (`block_sparse_moe.experts.{e}.w1/
w2/w3`, as transformers' save_pretrained writes them); transformers' modules hold them stacked
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) — the converted checkpoint holds them as the
MLA model's modules do, the same values rearranged (`convert.layouts`)."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import convert
from convert.cli import main
from convert.plan import plan_for_config

from conftest import assert_same_as_transformers, hf_model, random_ids, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
LAYOUTS = ("absorbed", "factored")


def mixtral(dtype=torch.float32, seed: int = 0):
    """A tiny random Mixtral: 6 query heads, 2 KV heads, 4 experts, 2 per token."""
    return hf_model("mixtral", seed=seed, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_equal_transformers(layout, dtype):
    model = mixtral(dtype)
    converted = convert.to_mla(model, layout=layout)
    assert_same_as_transformers(model, converted, TOL[dtype])


@pytest.fixture
def saved(tmp_path):
    model = mixtral()
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    return model, tmp_path / "src"


def test_cli_converts_per_expert_checkpoint_and_passes_the_experts_through(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    model, src = saved
    stored = load_file(src / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in stored  # the on-disk layout
    result = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["greedy_match"]
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert not any("block_sparse_moe" in name for name in written)
    for i in range(2):
        prefix, old = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        w = {(e, n): stored[f"{old}experts.{e}.w{n}.weight"] for e in range(4) for n in (1, 2, 3)}
        assert torch.equal(written[prefix + "gate.weight"], stored[old + "gate.weight"])
        assert torch.equal(
            written[prefix + "experts.gate_up_proj"], torch.stack([torch.cat([w[e, 1], w[e, 3]]) for e in range(4)])
        )
        assert torch.equal(written[prefix + "experts.down_proj"], torch.stack([w[e, 2] for e in range(4)]))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # registered by `import convert`
    ids = random_ids()
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, model(ids).logits) <= TOL[torch.float32]


def test_streamed_verification_equals_whole(saved, tmp_path):
    from convert.verify import verify_paths

    _, src = saved
    convert.gqa2mla(src, tmp_path / "mla", verify=False, progress=False)
    whole, streamed = (
        verify_paths(src, tmp_path / "mla", e2e=mode, progress=False)["end_to_end"] for mode in ("whole", "streamed")
    )
    for key in ("ppl_original", "ppl_converted", "logits_rel_error"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-6), key


def test_a_missing_expert_weight_is_refused_naming_it(saved, tmp_path):
    _, src = saved
    path = src / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "model.layers.1.block_sparse_moe.experts.2.w3.weight" in result.stderr
    assert not (tmp_path / "out").exists()


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_mixtral_8x7b_plan():
    plan = plan_for_config(MIXTRAL_8X7B)
    exact = 8 * 128  # G·d = 1,024 per latent
    assert [layer.ranks for layer in plan.layers] == [{"rank_k": exact, "rank_v": exact}] * 32
    assert plan.cache_bytes_per_token() == (32 * 2 * exact * 2,) * 2  # bfloat16: 131,072 B, as GQA
    experts = plan.source_tensors["model.layers.31.mlp.experts.gate_up_proj"][0]
    assert experts == (8, 2 * 14336, 4096)  # passed through, not part of the conversion
    assert "model.layers.31.mlp.experts.gate_up_proj" not in plan.replaced
