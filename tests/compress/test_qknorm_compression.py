"""Compression of q/k-normed models (Qwen3, OLMo 2, Gemma 3) in the factored layout.

The norm needs every dim of a KV head's key (OLMo 2: of all of them), so the key latent
cannot lose dims before it. The norm stays exact: `k_down` gives the whole aligned key,
the norm runs on it, and `k_compress` (r_K × G·d) then caches r_K dims of the normed
keys, chosen by their calibration statistics (E[n nᵀ], and ∂loss/∂n for Fisher).
"""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main

from conftest import PROSE, hf_model, rel_err

FAMILIES = ["qwen3", "olmo2", "gemma3_text"]


def _key_width(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads * head_dim


@pytest.mark.parametrize("calibration", ["original", "sequential"])
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_on_the_span_of_the_calibration_text(family, calibration):
    """Calibrated on fewer tokens than the rank, every layer's normed keys and values on those
    tokens lie in the kept subspace: the compressed model reproduces the original there (so
    the norm, the projection after it and the up-projection are wired right), and not on
    other tokens (so it really is compressed)."""
    model = hf_model(family, dtype=torch.float64)
    rank = _key_width(model.config) - 4
    calib = torch.randint(0, 128, (1, rank - 8), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, 128, (1, rank - 8), generator=torch.Generator().manual_seed(2))
    converted = convert.to_mla(  # the statistics as measured: shrunk, they weight directions off the span too
        model, layout="factored", rank=rank, calib=calib, method="whitened", calibration=calibration, shrinkage=0.0
    )
    layer = converted.model.layers[0].self_attn
    assert layer.k_compress.weight.shape == (rank, _key_width(model.config))
    with torch.no_grad():
        assert rel_err(converted(calib).logits, model(calib).logits) < 1e-5
        assert rel_err(converted(other).logits, model(other).logits) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_fisher_budget_is_met_and_error_falls_with_the_cache(family):
    model = hf_model(family)
    calib = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    errors = []
    for ratio in (0.75, 0.5, 0.25):
        state = convert.convert_state_dict(
            model.state_dict(), model.config, layout="factored", kv_cache_ratio=ratio, calib=calib
        )
        compression = state.config["mla"]["compression"]
        assert compression["method"] == "fisher" and compression["cache_dims"] == compression["budget_dims"]
        assert compression["achieved_ratio"] == pytest.approx(ratio, abs=0.02)
        converted = convert.to_mla(model, layout="factored", kv_cache_ratio=ratio, calib=calib)
        with torch.no_grad():
            errors.append(rel_err(converted(ids).logits, model(ids).logits))
    assert errors[0] < errors[1] < errors[2]


@pytest.mark.slow
def test_cli_writes_loads_and_verifies_a_compressed_qwen3(tmp_path):
    model = hf_model("qwen3")
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    calib, text = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text(PROSE)
    text.write_text(PROSE[::-1])
    out = tmp_path / "mla"
    args = ["gqa2mla", str(tmp_path / "src"), "-o", str(out), "--layout", "factored", "--kv-cache-ratio", "0.5"]
    args += ["--calib", str(calib), "--text", str(text), "--tokens", "128", "--max-ppl-ratio", "1000", "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["ppl_ratio"] != 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["mla"]["compression"]["cache_dims"] == config["mla"]["compression"]["budget_dims"]
    loaded = convert.load_mla_model(out)
    ranks = [entry["rank_k"] for entry in config["mla"]["layers"]]
    for layer, rank in zip(loaded.model.layers, ranks):
        width = _key_width(model.config)
        assert layer.self_attn.k_down.weight.shape[0] == width
        assert (layer.self_attn.k_compress is None) == (rank == width)
    again = CliRunner().invoke(main, ["verify", str(tmp_path / "src"), str(out), "--text", str(text), "-q"])
    assert again.exit_code in (0, 1), again.output  # re-verified; its verdict is the ppl rule's


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"kv_cache_ratio": 0.5}, "layout='factored'"),  # absorbed (the default layout)
        ({"kv_cache_ratio": 0.5, "layout": "factored", "method": "svd"}, "calib=FILE"),
    ],
)
def test_what_is_not_covered_is_refused_with_the_alternative(options, fragment):
    with pytest.raises(convert.ConvertError, match="q/k norm") as refused:
        convert.to_mla(hf_model("qwen3"), **options)
    assert fragment in str(refused.value)


def test_cached_generation_equals_full_recomputation():
    """The cache holds the compressed normed keys (r_K per token): decoding from it gives the
    tokens that recomputing the whole sequence at every step gives."""
    model = hf_model("qwen3")
    calib = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    converted = convert.to_mla(model, layout="factored", kv_cache_ratio=0.5, calib=calib)
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    cached = converted.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(16):
            ids = torch.cat([ids, converted(ids).logits[:, -1:].argmax(-1)], dim=-1)
    assert torch.equal(cached, ids)
    cache = converted(prompt, use_cache=True).past_key_values
    ranks = [layer.self_attn.rank_k for layer in converted.model.layers]
    assert min(ranks) < _key_width(model.config)  # some layer caches compressed normed keys
    assert [layer.keys.shape[-1] for layer in cache.layers] == ranks  # compressed keys, not G·d
