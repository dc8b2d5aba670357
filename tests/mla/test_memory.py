"""As lean as the original, the CPU proxy: the peak of the bytes torch allocates during a prefill
(no grad, a KV cache filled), measured with torch.profiler's memory events
(`bench/_common.AllocationPeak`), for each converted layout and a compression against transformers'
own SDPA attention on the same model, at a shape where attention dominates the activations (hidden
256, 8 heads, 2 KV heads, head dim 32, 2 layers, vocabulary 128; batch 2 × 512 tokens). Neither the
original nor a conversion allocates a (B, H, L, S) score tensor. `bench/train_step.py` measures the
same on SmolLM2 (prefill, training steps under `Trainer`, `torch.compile`); its tiny run is here."""

import json
import subprocess
import sys

import pytest
import torch

import convert

from conftest import REPO, bench_module, hf_model

BATCH, LENGTH = 2, 512
SHAPE = dict(
    hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=128, num_hidden_layers=2
)
# One (B, H, L, S) float32 score tensor of the prefill: 16 MiB
SCORES_BYTES = BATCH * SHAPE["num_attention_heads"] * LENGTH * LENGTH * 4


C = bench_module("_common")  # the benchmarks' helpers (AllocationPeak)

# name -> to_mla options (None: the original)
VARIANTS = {
    "original": None,
    "absorbed": dict(layout="absorbed"),
    "factored": dict(layout="factored"),
    "factored-kv0.5": dict(layout="factored", kv_cache_ratio=0.5),
    "absorbed-kv0.5": dict(layout="absorbed", kv_cache_ratio=0.5),
}


@pytest.fixture(scope="module")
def prefill_peaks():
    """name -> AllocationPeak of one prefill (batch 2 × 512, use_cache=True, no grad), after a warm-up."""
    original = hf_model("llama", **SHAPE)
    assert original.config._attn_implementation == "sdpa"  # transformers' default: the bound to meet
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, LENGTH), generator=gen)
    calib = torch.randint(0, SHAPE["vocab_size"], (1, 1024), generator=gen)
    peaks = {}
    for name, options in VARIANTS.items():
        if options is None:
            model = original
        else:
            # refinement changes the weights' values only, not what a prefill allocates
            extra = {"calib": calib, "refine_steps": 0} if options.get("kv_cache_ratio") else {}
            model = convert.to_mla(original, **options, **extra)
        with torch.no_grad():
            model(ids[:, :16], use_cache=True)  # warm-up: lazily built state is not the prefill's
            with C.AllocationPeak("cpu", detail=True) as peak:
                out = model(ids, use_cache=True)
        assert out.past_key_values.get_seq_length() == LENGTH
        del out
        peaks[name] = peak
    return peaks


def _figures(peaks, name) -> str:
    ref = peaks["original"].bytes
    return f"{name} {peaks[name].bytes:,} B vs the original's {ref:,} B ({peaks[name].bytes / ref:.3f}×)"


# Measured (torch 2.13 CPU, transformers 5.24): the original's prefill peaks at 8,523,776 B; absorbed
# 7,517,184 (0.88×), factored 7,779,328 (0.91×); at half the cache absorbed 6,295,552 (0.74×),
# factored 7,255,040 (0.85×). Before the heads were attended in chunks, 1.338×, 1.156× and 1.094×
# (factored at half): the absorbed queries are G× the original's, the factored layout's up-projected
# keys and values H/G×.
@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "original"])
def test_prefill_peak_at_most_the_originals(prefill_peaks, name):
    """The prefill's peak bytes allocated ≤ the original's (transformers' SDPA attention) × 1.0."""
    peak = prefill_peaks[name]
    assert peak.bytes <= prefill_peaks["original"].bytes, _figures(prefill_peaks, name) + "\n" + peak.top(8)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_score_tensor_in_a_prefill(prefill_peaks, name):
    """No (B, H, L, S) scores: no allocation that large, and the whole peak well below one."""
    peak = prefill_peaks[name]
    assert peak.largest < SCORES_BYTES, f"{name}: an allocation of {peak.largest:,} B\n" + peak.top(8)
    assert peak.bytes < SCORES_BYTES, f"{name}: peak {peak.bytes:,} B ≥ one score tensor\n" + peak.top(8)


def test_allocation_peak_counts_what_a_block_holds_at_once():
    """The proxy itself: allocations and frees paired by address; a free of memory allocated before
    the block is not counted (the figure never undershoots); a tensor kept counts."""
    older = torch.empty(3_000_000, dtype=torch.uint8)
    with C.AllocationPeak("cpu", detail=True) as peak:
        a = torch.empty(4_000_000, dtype=torch.uint8)
        b = torch.empty(8_000_000, dtype=torch.uint8)
        del a, older
        c = torch.empty(2_000_000, dtype=torch.uint8)
    assert peak.bytes == 12_000_000 and peak.largest == 8_000_000
    assert [size for size, _ in peak.live_at_peak] == [8_000_000, 4_000_000]
    assert "test_allocation_peak_counts_what_a_block_holds_at_once" in peak.live_at_peak[0][1]
    result, bytes_ = C.peak_allocated(torch.zeros, 1000, dtype=torch.float64)
    assert bytes_ == 8000 and result.shape == (1000,)
    del b, c


@pytest.mark.slow
def test_train_step_bench_runs_tiny(tmp_path):
    """bench/train_step.py --model tiny: every model and figure of the SmolLM2 run, with the ratios
    to the original; torch.compile (tens of seconds a model on CPU) for the original and one
    conversion, on one decoder layer."""
    out = tmp_path / "train_step.json"
    cmd = [sys.executable, str(REPO / "bench" / "train_step.py"), "--model", "tiny", "--wait", "0", "--out", str(out)]
    cmd += ["--steps", "3", "--repeats", "1", "--window", "64", "--prefill-tokens", "512", "--threads", "1"]
    cmd += ["--compile-layers", "1", "--compile-models", "original", "absorbed"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    data = json.loads(out.read_text())
    models = data["summary"]
    assert list(models) == [
        "original",
        "absorbed",
        "absorbed-factored",
        "factored",
        "factored-kv0.25",
        "absorbed-kv0.25",
        "factored-kv0.5",
        "absorbed-kv0.5",
        "absorbed-kv0.75",
    ]
    for name, row in models.items():
        assert row["prefill_peak_bytes"] > 0 and row["prefill_kv_cache_bytes"] > 0
        for checkpointing in ("off", "on"):
            step = row["train"][checkpointing]
            assert step["median_step_s"] > 0 and step["peak_bytes"] > step["state_bytes"] > 0
            if name != "original":
                assert step["time_ratio"] > 0 and step["peak_ratio"] > 0
    assert models["factored-kv0.25"]["prefill_kv_cache_bytes"] < models["factored"]["prefill_kv_cache_bytes"]
    # the factored form multiplies less than the dense absorbed maps (r = 2·d a head here)
    assert 0 < models["absorbed-factored"]["train_matmul_flops"] < models["absorbed"]["train_matmul_flops"]
    assert models["original"]["compile_s"] > 0 and models["absorbed"]["compile_ratio"] > 0
    assert models["factored"]["compile_s"] is None and data["compile_models"] == ["original", "absorbed"]
