"""A real trained GQA checkpoint end to end: SmolLM2-135M-Instruct (9 query heads,
3 KV heads, RoPE θ=1e5, tied embeddings) converted exactly and checked on real
Austen prose. The model and text come through the package registries
(fixtures/realdata.py), built once per machine.

The model is loaded, Emma tokenized and each layout converted once per session
(conftest.py); the original's logits on each Emma window are computed once and
compared with both layouts."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.verify.e2e import compare_models

from conftest import EVAL_TOKENS, GREEDY_TOKENS

pytestmark = [pytest.mark.realdata, pytest.mark.slow]


def test_exact_ranks_and_cache(smollm2_converted):
    converted = smollm2_converted
    mla = converted.config["mla"]
    assert mla["n_layers"] == 30 and all(e["rank_k"] == 192 and e["rank_v"] == 192 for e in mla["layers"])
    assert converted.sizes["kv_cache_bytes_per_token_after"] == converted.sizes["kv_cache_bytes_per_token_before"]
    assert max(err for e in mla["layers"] for err in e["factor_error"].values()) < 1e-12


def test_perplexity_top1_and_greedy_match_the_original(
    smollm2_converted, smollm2_original_lm, emma_ids, smollm2_greedy_prompt, smollm2_original_greedy
):
    model = convert.load_mla_model(smollm2_converted.output)
    figures = compare_models(smollm2_original_lm, model, emma_ids, window=1024)
    print(json.dumps(figures, indent=1))
    assert figures["tokens"] >= EVAL_TOKENS
    assert abs(figures["ppl_ratio"] - 1) <= 1e-4, figures
    assert figures["top1_agreement"] >= 0.999, figures
    assert 10 < figures["ppl_original"] < 40  # trained model on English prose, not noise
    prompt = smollm2_greedy_prompt
    got = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    assert got.shape[-1] == prompt.shape[-1] + GREEDY_TOKENS
    assert torch.equal(got, smollm2_original_greedy)


def test_convert_verify_passes_on_real_text(smollm2_converted, smollm2, tmp_path):
    import realdata

    text = tmp_path / "persuasion.txt"
    text.write_text(realdata.austen_text("persuasion"))
    args = ["verify", str(smollm2), str(smollm2_converted.output), "--text", str(text), "--tokens", "256"]
    res = CliRunner().invoke(main, args + ["--dtype", "float32", "--report-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "verification.json").read_text())
    assert report["verdict"] == "PASS" and len(report["layers"]) == 30
    assert report["inputs"]["text"]["tokens"] == 256
    assert report["end_to_end"]["greedy_match"] is True  # --e2e auto: one whole model fits, or both


def test_fisher_compression_keeps_perplexity_at_half_the_cache(
    smollm2_tokenizer, smollm2_original, smollm2_original_lm, emma_ids
):
    """The goal at 50% of the GQA cache: perplexity ≤ 1.05× the original's, one-shot (the default:
    Fisher, sequential calibration, attention-output refinement), calibrated on Pride and
    Prejudice and evaluated on Emma (disjoint texts). Without the refinement it was ×1.076."""
    import realdata

    from convert.mla.model import build_mla_model
    from convert.verify.e2e import perplexity

    original = smollm2_original
    calib = torch.tensor(smollm2_tokenizer(realdata.austen_text("prideprejudice"))["input_ids"][:4096])[None]
    emma = emma_ids[:, :2048]  # the first two of the windows the exact tests compare
    state = convert.convert_state_dict(
        original.state_dict(), original.config, layout="factored", kv_cache_ratio=0.5, calib=calib
    )
    comp = state.config["mla"]["compression"]
    assert comp["method"] == "fisher" and comp["cache_dims"] == comp["budget_dims"] == comp["gqa_cache_dims"] // 2
    assert comp["refine_steps"] > 0  # refined by default
    ratio = perplexity(build_mla_model(state.config, dict(state)), emma) / perplexity(smollm2_original_lm, emma)
    print(f"fisher 50% factored: perplexity ×{ratio:.4f}")
    assert ratio <= 1.05
