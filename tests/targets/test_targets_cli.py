"""`--target transformers` through the CLI: an exact DeepseekV3ForCausalLM export, written
safely and verified end to end; `convert verify` re-checks it; flags it would ignore are refused."""

import json

import pytest
from click.testing import CliRunner

from convert.cli import main

from conftest import TINY_LLAMA


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
