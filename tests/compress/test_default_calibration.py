"""Compression on every kind of text (issue 65): without --calib a compression calibrates on the
shipped mix of four kinds (convert/corpus/), a window of each in turn; --calib takes several files
(text, JSONL, Parquet) or a shipped kind by name; a lossy conversion's report judges every kind of
the shipped held-out text, names the worst, gates on it (on --text when given), and says when the
calibration was one kind only. Statistics can be shrunk toward data-free ones (--shrinkage)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import convert
from convert.cli import main
from convert.compress.weights import shrunk
from convert.corpus import KINDS, ROOT, kind_documents
from convert.errors import ConvertError
from convert.linalg.weighted import weighted_spectrum
from convert.text import CALIB_WINDOW, calibration_ids, judging_ids

from conftest import FIXTURES, TINY_LLAMA


def _bytes_source(vocab_size: int = 256):
    """A checkpoint without a tokenizer (the tiny fixture's directory): its text is read as UTF-8 bytes."""
    return SimpleNamespace(root=TINY_LLAMA, config={"vocab_size": vocab_size})


def _ids(calib, n_tokens: int) -> torch.Tensor:
    return calibration_ids(_bytes_source(), SimpleNamespace(calib=calib, calib_tokens=n_tokens))


def _kind_bytes(kind: str, part: str = "calib") -> bytes:
    return b"".join(doc.encode("utf-8") for doc in kind_documents(kind, part))


def test_the_shipped_text_is_small_sourced_and_held_out_apart():
    files = sorted(p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
    assert [p.relative_to(ROOT).as_posix() for p in files] == sorted(
        f"{part}/{kind}.{'jsonl' if kind == 'dialogue' else 'txt'}" for part in ("calib", "held_out") for kind in KINDS
    )
    assert sum(p.stat().st_size for p in files) < 1_000_000  # "a few MB at most"
    sources = (ROOT / "SOURCES.md").read_text()
    for name in ("public domain", "PSF License Agreement", "BSD 3-Clause", *(p.name for p in files)):
        assert name in sources, name
    for kind in KINDS:  # no long line of a judging text is in the calibration text of its kind
        calib = set(_kind_bytes(kind).decode().splitlines())
        held = [line for line in _kind_bytes(kind, "held_out").decode().splitlines() if len(line) > 60]
        assert held and not calib.intersection(held), kind


@pytest.mark.realdata
def test_the_shipped_text_is_what_its_builder_makes():
    pytest.importorskip("realdata")
    built = subprocess.run([sys.executable, str(FIXTURES / "calib_set.py"), "--check"], capture_output=True, text=True)
    if built.returncode == 3:  # Debian replaced a source package's version: nothing to compare with
        pytest.skip(built.stderr.strip())
    assert built.returncode == 0, built.stderr


def test_the_default_calibration_takes_a_window_of_each_kind_in_turn():
    ids = _ids(None, 8 * CALIB_WINDOW + 5)
    assert ids.shape == (1, 8 * CALIB_WINDOW + 5)
    windows = ids[0, : 8 * CALIB_WINDOW].reshape(8, CALIB_WINDOW)  # (8 windows, 1024): two rounds of the kinds
    for i, kind in enumerate(KINDS):
        text = _kind_bytes(kind)
        assert bytes(windows[i].tolist()) == text[:CALIB_WINDOW], kind
        assert bytes(windows[4 + i].tolist()) == text[CALIB_WINDOW : 2 * CALIB_WINDOW], kind
    assert bytes(ids[0, 8 * CALIB_WINDOW :].tolist()) == _kind_bytes("fiction")[2 * CALIB_WINDOW :][:5]


def test_calib_files_of_each_format_share_the_windows(tmp_path):
    import datasets

    (tmp_path / "a.txt").write_text("a" * 1500)  # runs out in its second window
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": "b" * 1000}) for _ in range(5)))
    datasets.Dataset.from_dict({"text": ["c" * 4000]}).to_parquet(str(tmp_path / "c.parquet"))
    ids = _ids([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"], 5 * CALIB_WINDOW)
    text = bytes(ids[0].tolist()).decode()
    w = CALIB_WINDOW
    assert text[:w] == "a" * w and text[w : 2 * w] == "b" * w and text[2 * w : 3 * w] == "c" * w
    assert text[3 * w : 3 * w + 476] == "a" * 476  # a's rest, then its turns go to the others
    assert set(text[3 * w + 476 :]) == {"b", "c"} and len(text) == 5 * w


def test_a_shipped_kind_by_name_and_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file named "code" here
    assert bytes(_ids([Path("code")], 100)[0].tolist()) == _kind_bytes("code")[:100]
    with pytest.raises(ConvertError, match=r"calib .*nope\.txt: no such file"):
        _ids([tmp_path / "nope.txt"], 100)


def test_a_model_in_memory_needs_token_ids_to_calibrate():
    state = load_file(TINY_LLAMA / "model.safetensors")
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    with pytest.raises(ConvertError, match="without its tokenizer.*token ids"):
        convert.convert_state_dict(state, config, kv_cache_ratio=0.5, refine_steps=0)


def test_judging_text_is_the_held_out_part_of_every_kind():
    judged = judging_ids(None, 256, 300)
    assert list(judged) == list(KINDS)
    for kind, ids in judged.items():
        assert bytes(ids[0].tolist()) == _kind_bytes(kind, "held_out")[:300], kind


def _gqa2mla(tmp_path, *extra, name="out"):
    out = tmp_path / name
    args = ["gqa2mla", str(TINY_LLAMA), "-o", str(out), "-q", "--kv-cache-ratio", "0.5", "--refine-steps", "0"]
    result = CliRunner().invoke(main, [*args, *extra])
    report = json.loads((out / "verification.json").read_text()) if (out / "verification.json").exists() else None
    return result, report, out


def test_a_compression_needs_no_text_and_is_judged_on_every_kind(tmp_path):
    result, report, out = _gqa2mla(tmp_path, "--max-ppl-ratio", "100")
    assert result.exit_code == 0, result.output
    rows = report["end_to_end"]["by_text"]
    assert [r["text"] for r in rows] == list(KINDS) and all(r["tokens"] == 256 for r in rows)
    worst = max(rows, key=lambda r: r["ppl_ratio"])
    gate = report["decision"]["checks"][-1]
    assert gate["name"] == f"perplexity ratio on {worst['text']}" and gate["value"] == worst["ppl_ratio"]
    config = json.loads((out / "config.json").read_text())
    assert config["mla"]["compression"]["calib"] == list(KINDS)
    markdown = (out / "verification.md").read_text()
    assert "## Perplexity by kind of text" in markdown and f"- worst: {worst['text']}," in markdown
    assert "calibrated on one kind" not in markdown


def test_the_worst_kind_fails_the_gate(tmp_path):
    result, report, out = _gqa2mla(tmp_path, "--max-ppl-ratio", "1.0000001")
    assert result.exit_code == 1, result.output
    worst = max(report["end_to_end"]["by_text"], key=lambda r: r["ppl_ratio"])
    assert report["failures"][-1].startswith(f"perplexity ratio {worst['ppl_ratio']:.4f} on {worst['text']} >")


def test_one_kind_of_calibration_is_named_and_the_given_text_gates(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text(_kind_bytes("technical", "held_out").decode()[:4000])
    result, report, out = _gqa2mla(tmp_path, "--max-ppl-ratio", "100", "--calib", "fiction", "--text", str(text))
    assert result.exit_code == 0, result.output
    assert [r["text"] for r in report["end_to_end"]["by_text"]] == ["--text mine.txt", *KINDS]
    assert report["decision"]["checks"][-1]["name"] == "perplexity ratio on --text mine.txt"
    assert report["options"]["calibrated_on"] == ["fiction"]
    assert "calibrated on one kind of text (fiction)" in (out / "verification.md").read_text()
    again = CliRunner().invoke(main, ["verify", str(TINY_LLAMA), str(out), "--max-ppl-ratio", "100"])
    assert again.exit_code == 0 and "calibrated on one kind of text (fiction)" in again.output  # from config.json


def test_shrinkage_pulls_a_moment_toward_the_isotropic_one():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, dtype=torch.float64, generator=gen) * torch.tensor([10.0, 3, 1, 1, 0.1, 0.01, 0, 0])
    m = x.T @ x / 64  # (8, 8), two directions never excited
    assert torch.equal(shrunk(m, 0.0), m)
    half = shrunk(m, 0.5)
    assert torch.allclose(half.trace(), m.trace()) and torch.linalg.eigvalsh(half)[0] >= 0.5 * m.trace() / 8 - 1e-12
    w = torch.randn(16, 8, dtype=torch.float64, generator=gen)
    plain = weighted_spectrum(w, None, None)
    isotropic = weighted_spectrum(w, None, shrunk(m, 1.0))  # the data-free weighting: plain SVD's, scaled
    assert torch.allclose(isotropic / isotropic[0], plain / plain[0])
