"""Verification and the runnable MLA model (issue: verification report)."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from make_tiny import tiny_hf_model
from safetensors.torch import load_file, save_file

import convert
from convert.cli import main
from convert.mla.model import cache_bytes_per_token

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
    * 4
)


def _save(tmp_path, model_type="llama", **overrides):
    path = tmp_path / f"{model_type}-src"
    tiny_hf_model(model_type, **overrides).save_pretrained(path)
    return path


def _convert(src, out, **options):
    return convert.gqa2mla(src, out, progress=False, **options)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_exact_conversion_passes_with_figures(tmp_path, model_type, layout):
    src = _save(tmp_path, model_type)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    result = _convert(src, tmp_path / "out", layout=layout, text=text, tokens=64)
    report = json.loads((result.output / "verification.json").read_text())
    assert report["verdict"] == "PASS", report["failures"]
    assert result.passed
    assert len(report["layers"]) == 2 and all(r["rel_error"] <= 1e-5 for r in report["layers"])
    e2e = report["end_to_end"]
    assert e2e["top1_agreement"] == 1.0 and e2e["greedy_match"]
    assert abs(e2e["ppl_ratio"] - 1) < 1e-4
    assert report["inputs"]["text"]["tokens"] == 64
    assert report["device"]["type"] == "cpu"
    markdown = (result.output / "verification.md").read_text()
    assert "# Verification: PASS" in markdown and "| 1 |" in markdown
    assert (result.output / "verification_layers.png").read_bytes()[:4] == b"\x89PNG"


def _layer_failures(report):
    return [f for f in report["failures"] if f.startswith("layer")]


def test_wrong_head_map_fails_naming_the_layers(tmp_path):
    src = _save(tmp_path)
    result = _convert(src, tmp_path / "out", head_map="tiled")
    assert result.report["verdict"] == "FAIL"
    assert {f.split(":")[0] for f in _layer_failures(result.report)} == {"layer 0", "layer 1"}


def test_one_perturbed_tensor_fails_naming_its_layer(tmp_path):
    src = _save(tmp_path)
    out = _convert(src, tmp_path / "out", verify=False).output
    weights = load_file(out / "model.safetensors")
    weights["model.layers.1.self_attn.v_down.weight"][3, 5] += 0.05
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    runner = CliRunner()
    res = runner.invoke(main, ["verify", str(src), str(out), "--tokens", "32", "-q"])
    assert res.exit_code == 1, res.output
    report = convert.verify.verify_paths(src, out, tokens=32, progress=False)
    assert [f.split(":")[0] for f in _layer_failures(report)] == ["layer 1"]


def test_original_changed_after_conversion_fails(tmp_path):
    src = _save(tmp_path)
    out = _convert(src, tmp_path / "out", verify=False).output
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] *= 1.01
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    report = convert.verify.verify_paths(src, out, tokens=32, progress=False)
    assert report["verdict"] == "FAIL"
    assert [f.split(":")[0] for f in _layer_failures(report)] == ["layer 0"]


def test_verify_cli_passes_and_writes_report(tmp_path):
    src = _save(tmp_path)
    out = _convert(src, tmp_path / "out", verify=False).output
    res = CliRunner().invoke(
        main, ["verify", str(src), str(out), "--tokens", "32", "--report-dir", str(tmp_path / "rep")]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "rep" / "verification.json").read_text())["verdict"] == "PASS"


def test_cuda_request_without_gpu_is_bad_input(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --device cuda is valid here")
    src = _save(tmp_path)
    res = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(tmp_path / "out"), "--device", "cuda", "-q"])
    assert res.exit_code == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_generate_matches_original_with_latent_only_cache(tmp_path, layout):
    src = _save(tmp_path, "qwen2")
    out = _convert(src, tmp_path / "out", layout=layout, verify=False).output
    original = tiny_hf_model("qwen2")
    mla_model = convert.load_mla_model(out)
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    want = original.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    got = mla_model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    mla = json.loads((out / "config.json").read_text())["mla"]
    cache = mla_model(prompt, use_cache=True).past_key_values
    for layer, entry in zip(cache.layers, mla["layers"]):
        assert layer.keys.shape == (1, 1, prompt.shape[1], entry["rank_k"])  # one latent, no heads
        assert layer.values.shape == (1, 1, prompt.shape[1], entry["rank_v"])
    latent_bytes = sum(e["rank_k"] + e["rank_v"] for e in mla["layers"]) * 4
    assert cache_bytes_per_token(mla_model) == latent_bytes  # the latents: config.json's figure
    if layout == "factored":  # the key positions RoPE needs are kept beside them, in a twin layer
        for layer in cache.layers:
            assert layer.mla_positions.keys.shape == (1, 1, prompt.shape[1], 1)


def test_joint_latent_caches_one_tensor(tmp_path):
    """A seed-notation checkpoint has no runnable LM; joint latents are checked per layer."""
    torch.manual_seed(0)
    H, G, d, D = 4, 2, 8, 32
    tensors = {
        f"layers.{i}.W_{m}.weight": torch.randn(r, c)
        for i in range(2)
        for m, (r, c) in {"Q": (H * d, D), "K": (G * d, D), "V": (G * d, D), "O": (D, H * d)}.items()
    }
    src = tmp_path / "seed.safetensors"
    save_file(tensors, src)
    result = _convert(src, tmp_path / "out", arch="seed", n_heads=H, latent="joint")
    assert result.passed, result.report["failures"]
    assert result.report["end_to_end"] is None and "no transformers" in result.report["end_to_end_skipped"]
    assert result.config["mla"]["layers"][0]["rank_kv"] == 2 * G * d


def test_verification_dtype_auto_follows_the_checkpoint():
    """--dtype auto runs a float32 checkpoint in float64 (round-off 1e-16 shows an exact
    conversion's 1e-7) and a half-precision one in float32 (its own rounding, 2^-8, is what
    there is to see; float64 would double every layer's memory for nothing); a given dtype wins."""
    from convert.options import VerifyOptions

    auto = VerifyOptions()
    assert auto.dtype == "auto"
    assert auto.run_dtype(torch.float32) == torch.float64 and auto.run_dtype(torch.float64) == torch.float64
    assert auto.run_dtype(torch.bfloat16) == torch.float32 and auto.run_dtype(torch.float16) == torch.float32
    assert VerifyOptions(dtype="float64").run_dtype(torch.bfloat16) == torch.float64
    assert VerifyOptions(dtype="float32").run_dtype(torch.float32) == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_half_precision_checkpoint_factors_in_float32_and_passes_its_layer_checks(tmp_path, dtype, layout):
    """A half-precision checkpoint's exact factorizations and absorbed products run in float32
    (`work_dtype`: half the time of float64 at 8B scale): they still reconstruct every K/V
    projection to float32 precision — a factorization in the checkpoint's own precision would
    be off by ~1e-3 — and every layer's check passes at the checkpoint's bound."""
    src = _save(tmp_path, dtype=dtype)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    result = _convert(src, tmp_path / "out", layout=layout, text=text, tokens=64)
    report = json.loads((result.output / "verification.json").read_text())
    assert report["dtype"] == "float32" and not _layer_failures(report)
    errors = [e for layer in result.config["mla"]["layers"] for e in layer["factor_error"].values()]
    assert 0 < max(errors) < 1e-5  # float32's round-off: not float64's 1e-15, not bfloat16's 1e-3
    stored = load_file(result.output / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {dtype}


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_a_fail_says_why_on_stderr(tmp_path, quiet):
    """Exit 1 prints one stderr line per failed check (with -q too), then where the report is. Without
    -q, off a terminal, the phases' progress lines ("converting: layer 2/2, ...", "end-to-end check ...")
    come first."""
    src, out = _save(tmp_path), tmp_path / "out"
    result = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(out), "--head-map", "tiled", *quiet])
    assert result.exit_code == 1, result.output
    report = json.loads((out / "verification.json").read_text())
    progress = r"[\w ()]+: \w+ \d+/\d+, |.* \.\.\.$|[\w -]+: done in |.*, still working$"
    lines = [line for line in result.stderr.strip().splitlines() if not re.match(progress, line)]
    assert lines == [f"FAIL: {f}" for f in report["failures"]] + [f"report: {out / 'verification.md'}"]
    assert lines[0].startswith("FAIL: layer 0: attention output relative error")
    assert ("verifying: layer 2/2" in result.stderr) == (not quiet)
