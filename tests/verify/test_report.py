"""What the report and the messages tell a user (issue: "Report and messages"): the verdict,
the rule that decided it and the figures against their bounds come first; KV-cache bytes are
the checkpoint's; compression without calibration text and impossible ranks are refused
before any work, with the fix."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.errors import ConvertError

from conftest import PROSE, TINY_LLAMA


def _convert(tmp_path, *extra):
    return CliRunner().invoke(main, ["gqa2mla", str(TINY_LLAMA), "-o", str(tmp_path / "out"), "-q", *extra])


@pytest.fixture(scope="module")
def float64_run(tmp_path_factory):
    """An exact conversion of the float32 checkpoint, verified in float64."""
    out = tmp_path_factory.mktemp("report") / "out"
    result = convert.gqa2mla(TINY_LLAMA, out, dtype="float64", tokens=64, progress=False)
    return result, (out / "verification.md").read_text()


def test_report_opens_with_verdict_rule_and_bounds(float64_run):
    result, markdown = float64_run
    lines = markdown.splitlines()
    assert lines[0] == "# Verification: PASS"
    assert lines[2] == "Decided by the exact conversion: round-off bounds of float32."  # the checkpoint's dtype
    decision = result.report["decision"]
    names = [c["name"] for c in decision["checks"]]
    assert names[0] == "tensors copied from the original, byte for byte"
    assert names[1:3] == ["layer 0 relative error", "layer 1 relative error"]
    assert names[3:] == ["logits relative error", "perplexity ratio − 1 (abs.)", "top-1 agreement"]
    assert all(c["ok"] for c in decision["checks"]) and decision["failures"] == []
    table = markdown[: markdown.index("## Per layer")]
    assert "| worst layer relative error" in table and "≤ 1e-05" in table and "≥ 0.999" in table


def test_kv_cache_bytes_are_the_checkpoints_in_a_float64_run(float64_run):
    result, markdown = float64_run
    e2e = result.report["end_to_end"]
    # float32 checkpoint: 2 layers × 2·G·d = 2 × 64 values × 4 B, whatever the run's precision
    assert e2e["kv_cache_dtype"] == "float32"
    assert e2e["kv_cache_bytes_per_token_converted"] == result.sizes["kv_cache_bytes_per_token_after"] == 512
    assert e2e["kv_cache_bytes_per_token_original"] == result.sizes["kv_cache_bytes_per_token_before"] == 512
    assert "KV cache bytes/token original → converted (float32) | 512 → 512" in markdown


def test_greedy_check_without_tokenizer_shows_ids(float64_run):
    result, markdown = float64_run
    assert result.report["end_to_end"]["greedy_text_original"] is None  # the fixture has no tokenizer
    assert "Greedy tokens: original [" in markdown


def test_lossy_report_says_the_ppl_ratio_decided(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged. " * 40)
    args = ["--kv-cache-ratio", "0.5", "--method", "svd", "--text", str(text), "--max-ppl-ratio", "1000"]
    result = _convert(tmp_path, *args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    rule = report["decision"]["rule"]
    assert rule.startswith("lossy conversion: perplexity ratio ≤ --max-ppl-ratio 1000.0 on --text when given")
    assert [c["name"] for c in report["decision"]["checks"]][1:] == ["perplexity ratio on --text t.txt"]
    markdown = (tmp_path / "out" / "verification.md").read_text()
    assert "## Per layer (information: a lossy conversion is judged by perplexity)" in markdown
    assert "1e-05" not in markdown.split("## Per layer")[0]  # no exact-conversion bound is shown as applied


def test_compression_without_a_bound_is_refused_with_the_fix(tmp_path):
    result = _convert(tmp_path, "--kv-cache-ratio", "0.5")
    assert result.exit_code == 2
    assert "--max-ppl-ratio R" in result.stderr and "--no-verify" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank", ["40", "33"])
def test_rank_above_exact_names_the_exact_ranks(tmp_path, rank):
    # tiny Llama: G·d = 2·16 = 32 for keys and values
    result = _convert(tmp_path, "--rank", rank, "--text", str(TINY_LLAMA / "config.json"))  # no --max-ppl-ratio
    assert result.exit_code == 2
    assert f"--rank {rank} is above the exact rank of layer 0 (rank_k 32, rank_v 32)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_rank_equal_to_exact_is_the_exact_conversion():
    model_state = convert.convert_state_dict(_tiny_state(), _tiny_config(), rank=32)
    assert model_state.config["mla"]["compression"] is None
    assert model_state.plan.cache_dims == model_state.plan.gqa_cache_dims


def test_cuda_without_a_gpu_is_a_convert_error_from_the_api(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConvertError, match="device='cuda'"):
        convert.gqa2mla(TINY_LLAMA, tmp_path / "out", device="cuda")
    assert not (tmp_path / "out").exists()


def _tiny_state():
    from safetensors.torch import load_file

    return load_file(TINY_LLAMA / "model.safetensors")


def _tiny_config():
    return json.loads((TINY_LLAMA / "config.json").read_text())


def _converted_copy(tmp_path, float64_run):
    import shutil

    result, _ = float64_run
    copy = tmp_path / "copy"
    shutil.copytree(result.output, copy)
    return copy


def test_verify_fails_when_a_copied_tensor_was_changed(tmp_path, float64_run):
    from safetensors.torch import load_file, save_file

    copy = _converted_copy(tmp_path, float64_run)
    tensors = load_file(copy / "model.safetensors")
    tensors["model.embed_tokens.weight"][0] += 1.0  # one row: random verification tokens may never read it
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["verify", str(TINY_LLAMA), str(copy), "--dtype", "float32", "-q"])
    assert result.exit_code == 1 and result.stdout.strip() == "FAIL"
    assert result.stderr.splitlines()[0] == (
        "FAIL: 1 tensor(s) copied from the original differ from it, e.g. 'model.embed_tokens.weight'"
    )


def test_verify_refuses_a_pair_whose_configs_differ(tmp_path, float64_run):
    copy = _converted_copy(tmp_path, float64_run)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["verify", str(TINY_LLAMA), str(copy), "--dtype", "float32", "-q"])
    assert result.exit_code == 2 and "rms_norm_eps=0.001" in result.stderr and "ORIGINAL" in result.stderr


@pytest.mark.parametrize("e2e", ["whole", "streamed"])
def test_one_kv_cache_figure_for_a_compressed_factored_output(e2e, tmp_path):
    """The factored layout also keeps each token's position (8 B per layer) beside its latents; the
    one figure, in the summary, config.json, the report and the README's table, counts the latents
    only (docs/design.md), whether the report measured whole models or computed it streamed."""
    text = tmp_path / "text.txt"
    text.write_text(PROSE)
    out = tmp_path / "out"
    args = ["gqa2mla", str(TINY_LLAMA), "-o", str(out), "--layout", "factored", "--kv-cache-ratio", "0.5"]
    args += ["--method", "svd", "--text", str(text), "--max-ppl-ratio", "100", "--e2e", e2e]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    summary = next(line for line in result.stdout.splitlines() if line.startswith("KV cache per token"))
    config = json.loads((out / "config.json").read_text())
    compression = config["mla"]["compression"]
    from_config = compression["cache_dims"] * 4  # float32
    report = json.loads((out / "verification.json").read_text())["end_to_end"]
    assert report["mode"] == e2e
    assert from_config == report["kv_cache_bytes_per_token_converted"] == 256  # 2 layers x 32 dims x 4 B
    assert summary.startswith(f"KV cache per token: 512 B (GQA) -> {from_config} B (MLA)")
    assert f"| 512 → {from_config} |" in (out / "verification.md").read_text()


def test_convert_verify_prints_a_summary_and_the_whole_report_when_asked(tmp_path, float64_run):
    """As `gqa2mla` does: the verdict, one line per check it compared, greedy generation, and where
    the whole report is (-v prints it; --report-dir keeps it)."""
    result, markdown = float64_run
    args = ["verify", str(TINY_LLAMA), str(result.output), "--dtype", "float64"]
    short = CliRunner().invoke(main, args)
    assert short.exit_code == 0, short.output
    lines = short.stdout.splitlines()
    assert lines[0] == "verification: PASS (decided by the exact conversion: round-off bounds of float32)"
    checks = [line for line in lines if line.startswith("  ok ")]
    assert [line.split(":")[0].split(maxsplit=1)[1] for line in checks] == [
        "worst layer relative error (0)" if "(0)" in lines[1] else "worst layer relative error (1)",
        "tensors copied from the original, byte for byte",
        "logits relative error",
        "perplexity ratio − 1 (abs.)",
        "top-1 agreement",
    ]
    assert "  greedy continuation identical: yes (float64)" in lines
    assert lines[-1] == "the whole report: add -v, or --report-dir DIR to keep it" and len(lines) <= 10
    whole = CliRunner().invoke(main, [*args, "-v", "--report-dir", str(tmp_path / "rep")])
    assert whole.exit_code == 0 and whole.stdout.startswith("# Verification: PASS\n")
    assert whole.stdout.strip() == (tmp_path / "rep" / "verification.md").read_text().strip()
    kept = CliRunner().invoke(main, [*args, "--report-dir", str(tmp_path / "rep2")])
    assert kept.stdout.splitlines()[-1] == f"report: {tmp_path / 'rep2' / 'verification.md'}"
