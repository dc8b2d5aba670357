"""Progress off a terminal (pytest's capture is not a TTY): long work logs a plain line to stderr
at most every `INTERVAL` seconds and one at the end of each; a phase (a command is one) says it started
once it has run `FIRST` seconds, then a heartbeat speaks whenever `INTERVAL` passes with no line, for a
slow phase or a slow item; quick phases and quiet runs print nothing."""

import re
import time

import pytest
import torch
from click.testing import CliRunner

import convert
import convert.verify
from convert import cli
from convert import progress as progress_module
from convert.progress import opening, phase, progress

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
    for bar in ("converting", "verifying"):
        assert re.search(rf"^{bar}: layer \d+/\d+, .*done in", err, re.M), err


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


@pytest.fixture
def fast_beat(monkeypatch):
    """A heartbeat every 0.2 s of silence and a command's opening line after 0.1 s: slowed phases show them."""
    monkeypatch.setattr(progress_module, "INTERVAL", 0.2)
    monkeypatch.setattr(progress_module, "FIRST", 0.1)


def test_a_slow_phase_says_it_is_still_working(fast_beat, capsys):
    with phase("loading the model", True):
        time.sleep(1.0)  # no line of its own for five intervals
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading the model ..." and re.fullmatch(r"loading the model: done in 0:00:0\d", lines[-1])
    beats = lines[1:-1]
    assert len(beats) >= 2 and all(
        re.fullmatch(r"loading the model: 0:00:0\d elapsed, still working", b) for b in beats
    )
    time.sleep(0.5)
    assert capsys.readouterr().err == ""  # the heartbeat stopped with the phase


def test_a_slow_item_says_where_it_is(fast_beat, capsys):
    with opening("convert verify x", True):  # a command: its bars have a heartbeat
        for _ in progress(range(2), "verifying", "layer", True):
            time.sleep(0.6)
    lines = capsys.readouterr().err.splitlines()
    assert any(re.fullmatch(r"verifying: layer 0/2, 0:00:0\d elapsed, still working", line) for line in lines), lines
    assert lines[-1].startswith("verifying: layer 2/2, ") and "done in" in lines[-1]


def test_an_inner_bar_speaks_for_the_outer_phase(fast_beat, capsys):
    """Nested: the heartbeat speaks for the innermost, and only after a silence, so the outer phase
    adds no line of its own while its inner bar logs."""
    with phase("end-to-end check", True):
        for _ in progress(range(6), "streaming", "layer", True):
            time.sleep(0.15)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("streaming: layer ") for line in lines), lines


def test_a_quick_phase_says_nothing(fast_beat, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "FIRST", 0.5)
    with phase("comparing the copied tensors", True):
        time.sleep(0.1)
    time.sleep(0.3)
    assert capsys.readouterr().err == ""


def test_a_bar_left_by_an_error_says_nothing_more(fast_beat, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "FIRST", 0.5)
    with pytest.raises(ValueError), phase("converting", True):
        for _ in progress(range(3), "converting", "layer", True):
            raise ValueError("a corrupt layer")  # the error line says why
    time.sleep(0.5)
    assert capsys.readouterr().err == ""


def test_quiet_phases_and_bars_print_nothing(fast_beat, capfd):
    with phase("loading the model", False), opening("convert gqa2mla x", False):
        for _ in progress(range(2), "verifying", "layer", False):
            time.sleep(0.5)
    assert capfd.readouterr().err == ""


def test_an_opening_line_waits_for_a_quick_refusal(monkeypatch, fast_beat, capsys):
    with opening("convert gqa2mla x", True):
        time.sleep(0.5)
    assert capsys.readouterr().err.splitlines()[0] == "convert gqa2mla x ..."
    monkeypatch.setattr(progress_module, "FIRST", 0.5)
    with pytest.raises(ValueError), opening("convert gqa2mla x", True):
        raise ValueError("refused")  # the error line will be the only one
    time.sleep(0.7)
    assert capsys.readouterr().err == ""


def test_a_slowed_conversion_is_never_silent(fast_beat, monkeypatch, tmp_path):
    """`convert gqa2mla` off a terminal: its opening line first (before torch is loaded), then a
    line from every phase, a slowed end-to-end check's heartbeat included."""
    load_api, end_to_end = cli._load_api, convert.verify._end_to_end

    def slow(what):
        def slowed(*args, **kwargs):
            time.sleep(0.6)
            return what(*args, **kwargs)

        return slowed

    monkeypatch.setattr(cli, "_load_api", slow(load_api))
    monkeypatch.setattr(convert.verify, "_end_to_end", slow(end_to_end))
    result = CliRunner().invoke(cli.main, ["gqa2mla", str(TINY_LLAMA), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == f"convert gqa2mla {TINY_LLAMA} ...", lines
    start, end = (
        lines.index("end-to-end check ..."),
        next(i for i, l in enumerate(lines) if l.startswith("end-to-end check: done")),
    )
    assert any(re.fullmatch(r"end-to-end check: 0:00:0\d elapsed, still working", l) for l in lines[start:end]), lines


def test_a_slowed_evaluation_is_never_silent(fast_beat, monkeypatch):
    """`convert eval` off a terminal: its opening line, then the heartbeat while lm_eval runs (whose
    own bars are not timed)."""
    import convert.evaluate

    def slow_evaluate(dirs, tasks, original=None, **options):
        time.sleep(0.8)
        return {"models": [], "tasks": tasks}

    monkeypatch.setattr(convert.evaluate, "evaluate", slow_evaluate)
    monkeypatch.setattr(convert.evaluate, "render_markdown", lambda results: "table")
    result = CliRunner().invoke(cli.main, ["eval", str(TINY_LLAMA)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == f"convert eval {TINY_LLAMA} ...", lines
    assert sum(bool(re.fullmatch(r"convert eval .+: 0:00:0\d elapsed, still working", l)) for l in lines) >= 2, lines
    assert result.stdout.strip() == "table"
