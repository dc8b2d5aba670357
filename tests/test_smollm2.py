"""A real trained GQA checkpoint end to end: SmolLM2-135M-Instruct (9 query heads,
3 KV heads, RoPE θ=1e5, tied embeddings) converted exactly and checked on real
Austen prose. The model and text come through the package registries
(fixtures/realdata.py), built once per machine."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.verify.e2e import compare_models

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

EVAL_TOKENS = 8192
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    realdata = pytest.importorskip("realdata")
    return realdata.smollm2_dir()


@pytest.fixture(scope="module")
def emma_ids(smollm2):
    import realdata
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(realdata.austen_text("emma"))["input_ids"]
    assert len(ids) >= EVAL_TOKENS
    return torch.tensor(ids[:EVAL_TOKENS])[None]


@pytest.fixture(scope="module")
def original(smollm2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    return model.eval()


@pytest.fixture(scope="module", params=["absorbed", "factored"])
def converted(request, smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / f"smollm2-{request.param}"
    result = convert.gqa2mla(smollm2, out, layout=request.param, verify=False, progress=False)
    return result


def test_exact_ranks_and_cache(converted):
    mla = converted.config["mla"]
    assert mla["n_layers"] == 30 and all(e["rank_k"] == 192 and e["rank_v"] == 192 for e in mla["layers"])
    assert converted.sizes["kv_cache_bytes_per_token_after"] == converted.sizes["kv_cache_bytes_per_token_before"]
    assert max(err for e in mla["layers"] for err in e["factor_error"].values()) < 1e-12


def test_perplexity_top1_and_greedy_match_the_original(converted, original, emma_ids):
    model = convert.load_mla_model(converted.output)
    figures = compare_models(original, model, emma_ids, window=1024)
    print(json.dumps(figures, indent=1))
    assert figures["tokens"] >= 8192
    assert abs(figures["ppl_ratio"] - 1) <= 1e-4, figures
    assert figures["top1_agreement"] >= 0.999, figures
    assert 10 < figures["ppl_original"] < 40  # trained model on English prose, not noise
    prompt = emma_ids[:, 1000:1016]
    want = original.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    got = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    assert got.shape[-1] == prompt.shape[-1] + GREEDY_TOKENS
    assert torch.equal(got, want)


def test_convert_verify_passes_on_real_text(converted, smollm2, tmp_path):
    import realdata

    text = tmp_path / "persuasion.txt"
    text.write_text(realdata.austen_text("persuasion"))
    args = ["verify", str(smollm2), str(converted.output), "--text", str(text), "--tokens", "256", "--dtype", "float32"]
    res = CliRunner().invoke(main, args + ["--report-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "verification.json").read_text())
    assert report["verdict"] == "PASS" and len(report["layers"]) == 30
    assert report["inputs"]["text"]["tokens"] == 256


def test_fisher_compression_keeps_perplexity_at_half_the_cache(smollm2, original):
    """Issue target at 50% of the GQA cache: perplexity ≤ 1.15× the original's, one-shot,
    calibrated on Pride and Prejudice and evaluated on Emma (disjoint texts)."""
    import realdata
    from transformers import AutoTokenizer

    from convert.mla.model import build_mla_model
    from convert.verify.e2e import perplexity

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    calib = torch.tensor(tokenizer(realdata.austen_text("prideprejudice"))["input_ids"][:4096])[None]
    emma = torch.tensor(tokenizer(realdata.austen_text("emma"))["input_ids"][:2048])[None]
    state = convert.convert_state_dict(
        original.state_dict(), original.config, layout="factored", kv_cache_ratio=0.5, calib=calib
    )
    comp = state.config["mla"]["compression"]
    assert comp["method"] == "fisher" and comp["cache_dims"] == comp["budget_dims"] == comp["gqa_cache_dims"] // 2
    ratio = perplexity(build_mla_model(state.config, dict(state)), emma) / perplexity(original, emma)
    print(f"fisher 50% factored: perplexity ×{ratio:.4f}")
    assert ratio <= 1.15
