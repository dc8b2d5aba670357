"""`convert.evaluate` on SmolLM2-135M (real model, real text): lm_eval's perplexity is our own
(`compare_models`) on the same token ids, through loglikelihood_rolling and through the
`convert_ppl` task; the exact native conversion and the `--target transformers` export score what
the original scores, and the `--target vllm` export (lossy at SmolLM2's three key heads) runs both
tasks as vLLM computes it."""

# ruff: noqa: E402 (the imports follow the offline switches and the check for lm_eval)

import math
import os
import re

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

import convert
from convert.evaluate import (
    LOCAL_TASKS,
    TASKS_DIR,
    evaluate,
    hflm,
    load_model,
    packaged_dataset,
    render_markdown,
    tokenizer_for,
)
from convert.verify.e2e import compare_models, perplexity

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

CPU = torch.device("cpu")
TOL = 1e-5  # float32: lm_eval's log-softmax in float32, ours in float64
CALIB_TOKENS = 512  # the vllm export's calibration: enough to run, not to be good (bench/ measures that)


@pytest.fixture(scope="module")
def outputs(smollm2, tmp_path_factory) -> dict:
    """SmolLM2 as the native format (exact, absorbed) and both DeepSeek-V3 exports."""
    import realdata

    root = tmp_path_factory.mktemp("smollm2-eval")
    calib = root / "prideprejudice.txt"
    calib.write_text(realdata.austen_text("prideprejudice"), encoding="utf-8")
    options = {"verify": False, "progress": False}
    return {
        "mla": convert.gqa2mla(smollm2, root / "mla", **options).output,
        "transformers": convert.gqa2mla(smollm2, root / "transformers", target="transformers", **options).output,
        "vllm": convert.gqa2mla(
            smollm2, root / "vllm", target="vllm", calib=calib, calib_tokens=CALIB_TOKENS, **options
        ).output,
    }


@pytest.fixture(scope="module")
def results(smollm2, outputs) -> dict:
    """Both local tasks, every document, on the original and the three outputs."""
    return evaluate(list(outputs.values()), list(LOCAL_TASKS), original=smollm2, device="cpu", batch_size=16)


@pytest.fixture(scope="module")
def models(smollm2, outputs):
    """The original and the native conversion, loaded as `convert eval` loads them."""
    return load_model(smollm2, CPU, torch.float32), load_model(outputs["mla"], CPU, torch.float32)


def _scored(lm, text: str) -> torch.Tensor:
    """(1, N) what lm_eval scores: its prefix token, then the text's tokens, in one window."""
    ids = [lm.prefix_token_id, *lm.tok_encode(text)]
    assert len(ids) <= lm.max_length
    return torch.tensor([ids])


def _nll_sums(figures: dict) -> tuple[float, float]:
    """The summed NLLs behind `compare_models`'s two perplexities (exp of the mean over N - 1 tokens)."""
    n = figures["tokens"] - 1
    return math.log(figures["ppl_original"]) * n, math.log(figures["ppl_converted"]) * n


def test_lm_eval_loglikelihood_rolling_is_our_perplexity(smollm2, models):
    original, converted = models
    tokenizer = tokenizer_for(smollm2)
    lms = [hflm(model, tokenizer, length=4096) for model in models]
    text = (TASKS_DIR / "emma_chapter1.txt").read_text()
    ids = _scored(lms[0], text)
    assert ids.shape[-1] > 1000
    ours = _nll_sums(compare_models(original, converted, ids, window=ids.shape[-1]))
    request = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    theirs = [-lm.loglikelihood_rolling(request, disable_tqdm=True)[0] for lm in lms]
    assert ours == pytest.approx(theirs, rel=TOL)
    without_prefix = math.log(perplexity(original, ids[:, 1:], window=ids.shape[-1])) * (ids.shape[-1] - 2)
    assert abs(without_prefix / theirs[0] - 1) > 10 * TOL  # the slip this test catches is far outside TOL


def test_the_perplexity_task_is_our_perplexity(smollm2, models, results):
    """`convert_ppl`'s byte and word perplexities, from our own NLL per paragraph (one window each)."""
    lm = hflm(models[0], tokenizer_for(smollm2), length=results["max_length"])
    nll, n_bytes, n_words = [0.0, 0.0], 0, 0
    for doc in packaged_dataset("text", "emma_chapter1.txt", sample_by="paragraph")["test"]["text"]:
        ids = _scored(lm, doc)
        nll = [a + b for a, b in zip(nll, _nll_sums(compare_models(*models, ids, window=ids.shape[-1])))]
        n_bytes, n_words = n_bytes + len(doc.encode("utf-8")), n_words + len(re.split(r"\s+", doc))
    for model, total in zip(results["models"][:2], nll):  # the summed NLL behind each figure
        assert model["format"] in ("original", "mla")
        figures = model["results"]["convert_ppl"]
        assert math.log(figures["byte_perplexity"]) * n_bytes == pytest.approx(total, rel=TOL)
        assert math.log(figures["word_perplexity"]) * n_words == pytest.approx(total, rel=TOL)
        assert figures["bits_per_byte"] * n_bytes * math.log(2) == pytest.approx(total, rel=TOL)


def test_every_output_runs_both_tasks_and_the_exact_ones_score_the_original(results):
    original, mla, transformers, vllm = results["models"]
    assert [m["format"] for m in results["models"]] == ["original", "mla", "transformers", "vllm"]
    assert all(m["samples"] == {"convert_ppl": 9, "convert_mc": 32} for m in results["models"])
    for exact in (mla, transformers):
        for metric, value in original["results"]["convert_ppl"].items():
            if not metric.endswith("_stderr"):
                assert exact["results"]["convert_ppl"][metric] == pytest.approx(value, rel=1e-4), metric
        assert exact["results"]["convert_mc"]["acc"] == original["results"]["convert_mc"]["acc"]
        assert exact["results"]["convert_mc"]["acc_norm"] == original["results"]["convert_mc"]["acc_norm"]
    ratio = vllm["results"]["convert_ppl"]["word_perplexity"] / original["results"]["convert_ppl"]["word_perplexity"]
    assert 1.0 < ratio < 3.0, ratio  # lossy, and run as vLLM runs it (stock transformers' model is another)
    assert 0.0 <= vllm["results"]["convert_mc"]["acc"] <= 1.0
    print(render_markdown(results))
