"""The real Qwen2.5-Coder-1.5B-Instruct (fixtures/realdata.py: bfloat16 as published, its config.json
without `head_dim`; 12 query and 2 key/value heads of 128, q/k/v biases, untied output, RoPE θ=1e6) cut
to its first two decoder layers, real weights and vocabulary: what SmolLM2 cannot show (heads of 128,
biases, a published Qwen2 config, a 152K vocabulary) in minutes rather than the hours the whole model
takes through every path (`python bench/every_path.py --model qwen15b`, docs/serving.md)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

LAYERS = 2
TOKENS = 256


@pytest.fixture(scope="module")
def qwen_cut(tmp_path_factory) -> Path:
    """The 1.5B's embeddings, first LAYERS decoder layers, final norm and output head, as published."""
    realdata = pytest.importorskip("realdata")
    src = Path(realdata.qwen25_coder_dir())
    assert "head_dim" not in json.loads((src / "config.json").read_text())  # as Qwen2's published configs
    return realdata.first_layers(src, tmp_path_factory.mktemp("qwen25-coder") / "first-layers", LAYERS)


@pytest.fixture(scope="module")
def code_text(tmp_path_factory) -> Path:
    realdata = pytest.importorskip("realdata")
    path = tmp_path_factory.mktemp("text") / "code.txt"
    path.write_text(realdata.text_kind("code"), encoding="utf-8")
    return path


def gqa2mla(src: Path, out: Path, *options: str) -> tuple[int, dict, str]:
    res = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(out), "-q", *options])
    report = out / "verification.json"
    return res.exit_code, (json.loads(report.read_text()) if report.is_file() else {}), res.output


@pytest.fixture(scope="module")
def absorbed(qwen_cut, code_text, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("absorbed") / "out"
    code, report, output = gqa2mla(qwen_cut, out, "--text", str(code_text), "--tokens", str(TOKENS))
    assert code == 0 and report["verdict"] == "PASS", output + json.dumps(report.get("failures"))
    return out


def test_the_default_conversion_is_exact_in_bfloat16(absorbed):
    """Heads of 128 and biased keys, read from a config without head_dim: every layer's rank is the exact
    G·d = 256, and the bfloat16 verdict PASSes end to end on held-out code."""
    config = json.loads((absorbed / "config.json").read_text())
    mla = config["mla"]
    assert mla["head_dim"] == 128 and mla["n_heads"] == 12 and mla["n_kv_heads"] == 2
    assert all(e["rank_k"] == 256 and e["rank_v"] == 256 for e in mla["layers"])
    report = json.loads((absorbed / "verification.json").read_text())
    e2e = report["end_to_end"]
    assert report["inputs"]["text"]["tokens"] == TOKENS
    assert e2e["top1_agreement"] >= 0.99 and abs(e2e["ppl_ratio"] - 1) < 0.01, e2e


@pytest.mark.parametrize(
    "options", [["--layout", "factored"], ["--target", "transformers"]], ids=["factored", "transformers"]
)
def test_the_other_exact_paths_pass(qwen_cut, code_text, tmp_path, options):
    code, report, output = gqa2mla(
        qwen_cut, tmp_path / "out", *options, "--text", str(code_text), "--tokens", str(TOKENS)
    )
    assert code == 0 and report["verdict"] == "PASS", output + json.dumps(report.get("failures"))
    if options[0] == "--layout":
        assert len(report["layers"]) == LAYERS
    else:  # an export is checked end to end only (its layers are DeepseekV3's modules)
        assert report["end_to_end"]["top1_agreement"] >= 0.99, report["end_to_end"]


def test_a_damaged_layer_fails_verification(qwen_cut, absorbed, code_text, tmp_path):
    """One latent row of the second layer's keys zeroed: `convert verify` says FAIL and exits 1."""
    import tamper

    broken = tamper.tampered_copy(absorbed, tmp_path / "broken", "zero_key_latent_row", LAYERS - 1)
    args = ["verify", str(qwen_cut), str(broken), "--text", str(code_text), "--tokens", str(TOKENS)]
    res = CliRunner().invoke(main, args + ["--report-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    report = json.loads((tmp_path / "verification.json").read_text())
    assert report["verdict"] == "FAIL" and report["failures"]
