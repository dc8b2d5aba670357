"""Streamed end-to-end verification gives the whole-model figures (convert/verify/streamed.py).

The reference is `compare_models` on the two whole models (transformers' own original
class, and the converted model as `load_mla_model` builds it)."""

import pytest
import torch

from convert.api import gqa2mla
from convert.hf import load_original
from convert.io import open_checkpoint
from convert.mla.model import cache_bytes_per_token, load_mla_model, read_mla_config
from convert.verify import render_markdown, verify_paths
from convert.verify.e2e import compare_models
from convert.verify.run import VerifyRun
from convert.verify.streamed import VOCAB_CHUNK, compare_streamed, params
from convert.verify.streamed import cache_bytes_per_token as config_cache_bytes

FIGURES = ("logits_max_abs_diff", "logits_rel_error", "kl_mean", "kl_max", "top1_agreement")
FIGURES += ("ppl_original", "ppl_converted", "ppl_ratio")
# KL of an exact conversion is the rounding noise of float64 log-probabilities (~1e-16 each,
# times ~10 in magnitude): below this floor two correct summation orders differ relatively.
KL_NOISE = 1e-12


def assert_same_figures(streamed: dict, whole: dict) -> None:
    for key in FIGURES:
        floor = KL_NOISE if key.startswith("kl") else 0.0
        assert streamed[key] == pytest.approx(whole[key], rel=1e-6, abs=floor), key
    assert streamed["tokens"] == whole["tokens"] and streamed["window"] == whole["window"]


@pytest.mark.parametrize(
    "options",
    [{"layout": "factored"}, {"layout": "absorbed"}, {"layout": "absorbed", "kv_cache_ratio": 0.5, "method": "svd"}],
    ids=["factored", "absorbed", "compressed"],
)
def test_streamed_equals_whole_model(tiny_llama_dir, tmp_path, options, monkeypatch):
    out = tmp_path / "mla"
    gqa2mla(tiny_llama_dir, out, verify=False, progress=False, **options)
    config, mla = read_mla_config(out)
    monkeypatch.setattr("convert.verify.streamed.VOCAB_CHUNK", 7)  # several chunks, one ragged
    assert config["vocab_size"] > 7 * 2 and VOCAB_CHUNK > 7
    ids = torch.randint(0, config["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    dtype = torch.float64
    with open_checkpoint(tiny_llama_dir) as orig, open_checkpoint(out) as conv:
        ref, got = load_original(orig, config, "cpu", dtype), load_mla_model(out, "cpu", dtype)
        whole = compare_models(ref, got, ids, window=16)  # three windows, the last one short
        streamed = compare_streamed(VerifyRun(orig, conv, config, torch.device("cpu"), dtype), ids, window=16)
        assert_same_figures(streamed, whole)
        if "kv_cache_ratio" in options:
            assert whole["kl_mean"] > 1e-6 and whole["logits_rel_error"] > 1e-4  # really lossy: figures mean something
        ckpt = torch.float32
        expected = (cache_bytes_per_token(ref, as_dtype=ckpt), cache_bytes_per_token(got, as_dtype=ckpt))
        assert config_cache_bytes(mla, ckpt) == expected
        assert params(orig) == sum(p.numel() for p in ref.parameters())
        assert params(conv) == sum(p.numel() for p in got.parameters())


def test_streamed_report_says_greedy_was_skipped(tiny_llama_dir, tmp_path):
    out = tmp_path / "mla"
    gqa2mla(tiny_llama_dir, out, verify=False, progress=False)
    whole = verify_paths(tiny_llama_dir, out, tokens=24, e2e="whole", progress=False)
    report = verify_paths(tiny_llama_dir, out, tokens=24, e2e="streamed", progress=False)
    e2e = report["end_to_end"]
    assert report["verdict"] == "PASS" and e2e["mode"] == "streamed" and whole["end_to_end"]["mode"] == "whole"
    assert e2e["greedy_match"] is None and "--e2e streamed" in e2e["greedy_skipped"]
    assert whole["end_to_end"]["greedy_skipped"] is None and whole["end_to_end"]["greedy_match"]
    assert_same_figures(e2e, whole["end_to_end"])
    for key in ("kv_cache_bytes_per_token_original", "kv_cache_bytes_per_token_converted", "params_converted"):
        assert e2e[key] == whole["end_to_end"][key]
    markdown = render_markdown(report)
    assert "Greedy generation skipped: greedy generation needs a whole model" in markdown
    assert "| end-to-end mode | streamed |" in markdown


@pytest.mark.slow
def test_streamed_equals_whole_on_smollm2(smollm2, tmp_path):
    """The real model, 256 tokens of Emma: streamed == whole to 1e-6."""
    import realdata
    from transformers import AutoTokenizer

    out = tmp_path / "mla"
    gqa2mla(smollm2, out, verify=False, progress=False)
    config, _ = read_mla_config(out)
    text = realdata.austen_text("emma")[:20000]
    ids = torch.tensor(AutoTokenizer.from_pretrained(smollm2)(text)["input_ids"][:256])[None]
    dtype = torch.float32
    with open_checkpoint(smollm2) as orig, open_checkpoint(out) as conv:
        ref, got = load_original(orig, config, "cpu", dtype), load_mla_model(out, "cpu", dtype)
        whole = compare_models(ref, got, ids, window=128)
        del ref, got
        streamed = compare_streamed(VerifyRun(orig, conv, config, torch.device("cpu"), dtype), ids, window=128)
    assert whole["ppl_original"] < 100  # real text through the real model
    assert_same_figures(streamed, whole)


def test_sharded_output_verifies_before_commit(tiny_llama_dir, tmp_path):
    """Verification reads the uncommitted output: a sharded one needs its index there already."""
    result = gqa2mla(
        tiny_llama_dir, tmp_path / "mla", max_shard_size="100KB", e2e="streamed", tokens=16, progress=False
    )
    assert len(list((tmp_path / "mla").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "mla" / "model.safetensors.index.json").is_file()
    assert result.report["verdict"] == "PASS" and result.report["end_to_end"]["mode"] == "streamed"


def test_auto_streams_and_generates_greedily_one_model_at_a_time(tiny_llama_dir, tmp_path, monkeypatch):
    """auto with the memory free for one whole model but not two: the streamed figures, then greedy
    generation from each whole model in turn, in float32 for a float32 checkpoint (the whole mode's
    greedy tokens, there in float64); when one does not fit either, greedy generation streamed a
    decoder layer at a time gives the same tokens."""
    import convert.verify as verify_module
    from convert.verify import memory
    from convert.verify.memory import FREE_MARGIN_MIN, one_model_memory_bytes

    out = tmp_path / "mla"
    gqa2mla(tiny_llama_dir, out, verify=False, progress=False)
    whole = verify_paths(tiny_llama_dir, out, tokens=24, e2e="whole", progress=False)["end_to_end"]
    with open_checkpoint(out) as conv:  # the converted model (absorbed) is the larger one
        needed = one_model_memory_bytes(conv.total_bytes(), torch.float32, torch.float32)
    loads = []
    monkeypatch.setattr(verify_module, "greedy_in_turn", _spy(verify_module.greedy_in_turn, loads))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: FREE_MARGIN_MIN + needed)  # just fits
    run = lambda: verify_paths(tiny_llama_dir, out, tokens=24, progress=False, max_memory="1024GiB")["end_to_end"]
    auto = run()
    assert auto["mode"] == "streamed" and auto["greedy_skipped"] is None and auto["greedy_match"]
    assert len(auto["greedy_original"]) == 32 and auto["greedy_original"] == whole["greedy_original"]
    assert auto["greedy_converted"] == whole["greedy_converted"] and loads == [torch.float32]
    assert auto["greedy_dtype"] == "float32" and whole["greedy_dtype"] == "float64"
    assert_same_figures(auto, whole)
    free = FREE_MARGIN_MIN + needed - 1  # one byte short
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: free)
    streamed = run()
    assert streamed["mode"] == "streamed" and streamed["greedy_match"] and len(loads) == 1
    assert streamed["greedy_original"] == whole["greedy_original"]
    assert streamed["greedy_converted"] == whole["greedy_converted"]
    assert streamed["greedy_how"].startswith("streamed") and f"~{needed / 2**30:.2f} GiB" in streamed["greedy_how"]


def _spy(fn, calls: list):
    def spied(original, converted, config, ids, device, dtype):
        calls.append(dtype)
        return fn(original, converted, config, ids, device, dtype)

    return spied


def test_streamed_greedy_follows_a_converted_model_that_diverges(tiny_llama_dir, tmp_path):
    """A damaged conversion generates other tokens: streamed greedy generation gives each model's own
    continuation (the converted one's past where it leaves the original's), as whole models do."""
    from tamper import tampered_copy

    from convert.verify.e2e import GREEDY_NEW, GREEDY_PROMPT, greedy_in_turn
    from convert.verify.run import VerifyRun
    from convert.verify.streamed import greedy_streamed

    out = tmp_path / "mla"
    gqa2mla(tiny_llama_dir, out, verify=False, progress=False)
    bad = tampered_copy(out, tmp_path / "bad", "swap_query_heads", 0)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    with open_checkpoint(tiny_llama_dir) as orig, open_checkpoint(bad) as conv:
        config = read_mla_config(bad)[0]
        whole_ref, whole_got, *_ = greedy_in_turn(orig, bad, config, ids, torch.device("cpu"), torch.float32)
        run = VerifyRun(orig, conv, config, torch.device("cpu"), torch.float32)
        ref, got = greedy_streamed(run, ids, GREEDY_PROMPT, GREEDY_NEW, set())
    assert whole_ref != whole_got  # the damage shows in the tokens
    assert (ref, got) == (whole_ref, whole_got) and len(got) == GREEDY_NEW
