"""Progress off a terminal (pytest's capture is not a TTY): long work logs a plain line to stderr
at most every `INTERVAL` seconds and one at the end of each phase; quiet runs print nothing."""

import re

import pytest
import torch

import convert
from convert import progress as progress_module
from convert.progress import progress

from conftest import TINY_LLAMA, hf_model


@pytest.fixture
def every_item(monkeypatch):
    monkeypatch.setattr(progress_module, "INTERVAL", 0.0)


def test_lines_carry_the_count_and_an_eta(every_item, capsys):
    assert list(progress(range(4), "verifying", "layer", True)) == [0, 1, 2, 3]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5  # one per layer, then the end of the phase
    assert lines[0].startswith("verifying: layer 1/4,") and re.search(r"ETA \d+:\d\d:\d\d$", lines[0])
    assert lines[-1].startswith("verifying: layer 4/4,") and "done in" in lines[-1]


def test_no_line_more_often_than_the_interval(monkeypatch, capsys):
    times = iter([0.0, 5.0, 10.0, 31.0, 40.0, 60.0, 61.5, 62.0, 63.0])  # start, 7 items, close
    monkeypatch.setattr(progress_module, "_clock", lambda: next(times))
    list(progress(range(7), "converting", "layer", True))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "converting: layer 3/7",  # at 31 s
        "converting: layer 6/7",  # at 61.5 s, not at 60 (29 s after the last line)
        "converting: layer 7/7",  # the end
    ]
    assert "ETA 0:00:41" in lines[0]  # 4 layers left at 3 layers per 31 s


def test_a_conversion_logs_each_phase(every_item, tmp_path, capsys):
    convert.gqa2mla(TINY_LLAMA, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    for phase in ("converting", "verifying"):
        assert re.search(rf"^{phase}: layer \d+/\d+, .*done in", err, re.M), err


def test_a_quiet_conversion_logs_nothing(every_item, tmp_path, capfd):
    convert.gqa2mla(TINY_LLAMA, tmp_path / "out", progress=False)
    assert capfd.readouterr().err == ""


def test_healing_logs_steps_with_tokens_per_second(every_item, capsys):
    original = hf_model("llama")
    model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    options = {"steps": 3, "window": 32, "check_every": 0, "device": "cpu", "progress": True}
    convert.heal(model, ids, original=original, eval_texts=ids[:, :64], **options)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("healing:")]
    assert [line.split(",")[0] for line in lines] == [f"healing: step {n}/3" for n in (1, 2, 3, 3)]
    assert all(re.search(r"tokens/s=\d+", line) for line in lines)
