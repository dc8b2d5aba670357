"""`bench/compression.py --merge`: a run of some shares put into the model's table, which the docs render.

A row of the same variant and share is replaced, a new one appended, each recording the command that measured it;
a run on other text, or against another original perplexity, is refused and the table left as it was."""

import json

import pytest

from conftest import bench_module

B = bench_module("compression")
TEXTS = {"model": "Gemma 3 270M", "calib": {"book": "p", "tokens": 4096}, "eval": {"book": "n", "tokens": 4096}}


def _row(ratio: float, ppl_ratio: float, **extra) -> dict:
    return dict(
        method="fisher", layout="factored", ratio=ratio, nope_angle=None, calibration="sequential", refine_steps=50,
        ppl_ratio=ppl_ratio, **extra,
    )  # fmt: skip


def _result(rows: list[dict], command: str, heal_steps: int = 50, original: float = 61.26) -> dict:
    heal = {"book": "p", "tokens": 16384, "steps": heal_steps}
    machine = {"cpu": f"the CPU of {command}"}
    return TEXTS | {"original_ppl": original, "heal": heal, "rows": rows, "command": command, "machine": machine}


def test_merge_replaces_the_same_share_and_appends_a_new_one(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(_result([_row(0.5, 1.08), _row(0.25, 1.37, heal_steps=50)], "first")))
    run = _result([_row(0.5, 1.07, heal_steps=50, healed_ppl_ratio=1.05), _row(0.125, 2.05)], "second", 0)

    merged = B.merge(run, table)

    assert merged == json.loads(table.read_text())
    by_share = {r["ratio"]: r for r in merged["rows"]}
    assert [r["ratio"] for r in merged["rows"]] == [0.5, 0.25, 0.125]
    assert by_share[0.5]["ppl_ratio"] == 1.07 and by_share[0.5]["healed_ppl_ratio"] == 1.05
    assert by_share[0.5]["command"] == "second" and by_share[0.5]["heal_steps"] == 50
    assert by_share[0.125]["command"] == "second" and by_share[0.125]["heal_steps"] == 0  # one-shot
    assert by_share[0.125]["machine"] == {"cpu": "the CPU of second"}
    assert by_share[0.25] == _row(0.25, 1.37, heal_steps=50)  # not measured again: left as it was
    assert merged["command"] == "first"


@pytest.mark.parametrize(
    "change", [{"eval": {"book": "emma", "tokens": 4096}}, {"original_ppl": 61.3}, {"model": "SmolLM2-135M"}]
)
def test_merge_refuses_other_text_and_leaves_the_table(tmp_path, change):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(_result([_row(0.5, 1.08)], "first")))
    before = table.read_text()
    with pytest.raises(SystemExit, match="not merged"):
        B.merge(_result([_row(0.5, 1.07)], "second") | change, table)
    assert table.read_text() == before


def test_the_table_shows_every_kind_of_text_the_worst_first():
    """Issue 65: a table judged on several kinds shows each, and each row's worst, not only the first text."""
    kinds = [{"code": 1.07, "technical": 1.12, "fiction": 1.06}, {"code": 1.31, "technical": 1.20, "fiction": 1.02}]
    rows = [_row(0.5, 1.07, ppl_ratio_by_kind=kinds[0]), _row(0.25, 1.31, ppl_ratio_by_kind=kinds[1])]
    text = B.markdown(_result(rows, "first"))

    header = next(line for line in text.splitlines() if line.startswith("| layout | method | share | worst |"))
    assert header.split("|")[5:8] == [" code ", " technical ", " fiction "]  # by their worst: 1.31, 1.20, 1.06
    assert "| 50% | ×1.120 (technical) | ×1.070 | ×1.120 | ×1.060 |" in text
    assert "| 25% | ×1.310 (code) | ×1.310 | ×1.200 | ×1.020 |" in text


def test_the_kinds_table_of_saved_runs_keeps_one_column_per_text(tmp_path, capsys):
    """`--kinds-table A.json B.json`: the rows of several runs in one table; the judged book's own column goes
    where a kind's (its judging document) holds the same figures, and stays where they differ."""
    same = {"northangerabbey": 1.07, "fiction": 1.07, "technical": 1.10, "code": 1.08, "dialogue": 1.02}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_result([_row(0.5, 1.07, ppl_ratio_by_kind=same)], "a")))
    second.write_text(json.dumps(_result([_row(0.75, 1.01, ppl_ratio_by_kind={**same, "fiction": 1.01})], "b")))
    B.main(["--kinds-table", str(first)])
    one = capsys.readouterr().out
    assert "northangerabbey" not in one and "| 50% | ×1.100 (technical) |" in one
    B.main(["--kinds-table", str(first), str(second)])
    both = capsys.readouterr().out
    assert "northangerabbey" in both  # not the same as fiction in every row: kept
    assert both.index("| 75% |") < both.index("| 50% |")
