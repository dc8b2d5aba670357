"""`--target transformers` through the CLI: an exact DeepseekV3ForCausalLM export, written
safely and verified end to end; `convert verify` re-checks it; flags it would ignore are refused."""

import json
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from convert.cli import main

from conftest import CONVERT_STDERR_LINE, REPO, TINY_LLAMA


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-ds"
    result = CliRunner().invoke(
        main,
        [
            "gqa2mla",
            str(TINY_LLAMA),
            "-o",
            str(out),
            "--target",
            "transformers",
            "--dtype",
            "float32",
            "--tokens",
            "64",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


def test_export_is_a_deepseek_v3_checkpoint_that_passes(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "mla" not in config
    report = json.loads((exported / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["layers"] == []
    assert report["end_to_end"]["logits_rel_error"] < 1e-5 and report["end_to_end"]["greedy_match"]
    assert (exported / ".convert-manifest.json").is_file()


def test_convert_verify_rechecks_an_export(exported):
    result = CliRunner().invoke(main, ["verify", str(TINY_LLAMA), str(exported), "--dtype", "float32", "-q"])
    assert result.exit_code == 0 and result.output.strip() == "PASS"


@pytest.mark.parametrize("flags", [["--layout", "factored"], ["--rank", "8"], ["--latent", "joint"]])
def test_flags_an_export_would_ignore_are_refused(tmp_path, flags):
    args = ["gqa2mla", str(TINY_LLAMA), "-o", str(tmp_path / "out"), "--target", "transformers", "--no-verify", *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and flags[0] in result.stderr and "--target mla" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["transformers", "vllm", "llamacpp"])
def test_an_export_writes_only_converts_own_lines_on_stderr(target, tmp_path):
    """No third-party warning reaches the user (transformers' deprecations included: convert calls
    the current API), through the installed entry point in a fresh process, progress on; stdout's
    summary names the attention's parameters before and after (llamacpp's: counted in its file)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
        vocab_size=128, intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "src")  # vllm's exact case: one key head of 64
    args = ["gqa2mla", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--target", target, "--tokens", "64"]
    done = subprocess.run([sys.executable, str(REPO / "cli.py"), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines and not [line for line in lines if not CONVERT_STDERR_LINE.match(line)], done.stderr
    assert not re.search(r"warn|deprecat", done.stderr, re.I), done.stderr
    params = re.search(r"attention params ([\d,]+) -> ([\d,]+)", done.stdout)
    assert params and int(params.group(1).replace(",", "")) > 0 and int(params.group(2).replace(",", "")) > 0
