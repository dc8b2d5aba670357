"""`convert.evaluate` on the tiny fixtures: lm_eval's rolling log-likelihood is our own perplexity
(`compare_models`) on the same token ids, and the native directory and both DeepSeek-V3 exports
of an exact conversion score what the original scores on the local tasks, each run under HFLM."""

# ruff: noqa: E402 (the imports follow the offline switches and the check for lm_eval)

import math
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance
from transformers import LlamaConfig, LlamaForCausalLM

import convert
from convert.evaluate import LOCAL_TASKS, TASKS_DIR, evaluate, hflm, load_model, render_markdown, tokenizer_for
from convert.verify.e2e import compare_models

from conftest import TINY_LLAMA

CPU = torch.device("cpu")
TOL = 1e-5  # float32: lm_eval's log-softmax in float32, ours in float64


def lm_eval_nll(lm, text: str) -> float:
    """-(lm_eval's loglikelihood_rolling of `text`): its summed next-token NLL."""
    [loglikelihood] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    return -loglikelihood


def scored_ids(lm, text: str) -> torch.Tensor:
    """(1, N) the ids lm_eval scores: its prefix token, then the text's tokens, in one window."""
    ids = [lm.prefix_token_id, *lm.tok_encode(text)]
    assert len(ids) <= lm.max_length, "the text must fit one rolling window"
    return torch.tensor([ids])


def our_nll(figures: dict, key: str) -> float:
    """The summed NLL behind `compare_models`'s perplexity `key` (exp of the mean over N - 1 tokens)."""
    return math.log(figures[key]) * (figures["tokens"] - 1)


def test_lm_eval_perplexity_is_ours_on_the_fixture(tmp_path):
    convert.gqa2mla(TINY_LLAMA, tmp_path / "mla", verify=False, progress=False)
    original = load_model(TINY_LLAMA, CPU, torch.float32)
    converted = load_model(tmp_path / "mla", CPU, torch.float32)
    tokenizer = tokenizer_for(TINY_LLAMA)  # the fixture has none: ASCII codes, as convert.text reads it
    text = (TASKS_DIR / "emma_chapter1.txt").read_text()[:240]
    lm_original, lm_converted = hflm(original, tokenizer, length=256), hflm(converted, tokenizer, length=256)
    ids = scored_ids(lm_original, text)
    assert ids[0, 1:].tolist() == list(text.encode())  # the byte ids convert.text gives this model
    figures = compare_models(original, converted, ids, window=ids.shape[-1])
    ours = our_nll(figures, "ppl_original"), our_nll(figures, "ppl_converted")
    theirs = lm_eval_nll(lm_original, text), lm_eval_nll(lm_converted, text)
    assert ours[0] == pytest.approx(theirs[0], rel=TOL) and ours[1] == pytest.approx(theirs[1], rel=TOL)
    # The comparison can fail: the plausible slip of scoring the text without lm_eval's prefix
    # token (its first token unscored) is 50x the tolerance off.
    without_prefix = compare_models(original, original, ids[:, 1:], window=ids.shape[-1])
    assert abs(our_nll(without_prefix, "ppl_original") / theirs[0] - 1) > 10 * TOL


def _one_kv_head_llama(path):
    """A Llama with one key/value head of dim 64: vLLM's shape, so the vllm export is exact too."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
        vocab_size=128, intermediate_size=64, max_position_embeddings=1024,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.mark.slow
def test_the_native_format_and_both_exports_score_what_the_original_scores(tmp_path):
    src = _one_kv_head_llama(tmp_path / "src")
    for target in ("mla", "transformers", "vllm"):
        convert.gqa2mla(src, tmp_path / target, target=target, verify=False, progress=False)
    outputs = [tmp_path / target for target in ("mla", "transformers", "vllm")]
    results = evaluate(outputs, list(LOCAL_TASKS), original=src, limit=6, device="cpu")
    original, *converted = results["models"]
    assert [m["role"] for m in results["models"]] == ["original", "converted", "converted", "converted"]
    assert [m["format"] for m in results["models"]] == ["original", "mla", "transformers", "vllm"]
    assert original["samples"] == {"convert_ppl": 6, "convert_mc": 6}
    for model in converted:
        ppl, mc = model["results"]["convert_ppl"], model["results"]["convert_mc"]
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            assert ppl[metric] == pytest.approx(original["results"]["convert_ppl"][metric], rel=1e-4), model["label"]
        assert mc["acc"] == original["results"]["convert_mc"]["acc"], model["label"]
        assert mc["acc_norm"] == original["results"]["convert_mc"]["acc_norm"], model["label"]
    table = render_markdown(results)
    assert "| src (original) | mla (mla) | ratio | transformers (transformers) | ratio | vllm (vllm) | ratio |" in table
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:4]]
    ratios = [float(cell) for row in rows for cell in row[4::2]]  # word and byte perplexity, per export
    assert ratios == pytest.approx([1.0] * 6, abs=1e-5)


@pytest.mark.slow
def test_the_original_comes_from_the_verification_report(tmp_path):
    result = convert.gqa2mla(TINY_LLAMA, tmp_path / "mla", progress=False)
    assert result.passed
    results = evaluate([tmp_path / "mla"], "convert_mc", limit=2, device="cpu")
    assert [(m["role"], m["path"]) for m in results["models"]] == [
        ("original", str(TINY_LLAMA)),
        ("converted", str(tmp_path / "mla")),
    ]
    assert results["tasks"] == ["convert_mc"] and results["models"][0]["samples"] == {"convert_mc": 2}
