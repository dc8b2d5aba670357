"""`convert eval`: the side-by-side table and exit 0; bad input exits 2 and a missing lm_eval
exits 3, each with one line on stderr."""

# ruff: noqa: E402 (the imports follow the offline switches and the check for lm_eval)

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

import convert
import convert.progress
from convert.cli import main
from convert.errors import ConvertError
from convert.evaluate import evaluate

from conftest import REPO, TINY_LLAMA


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The fixture converted and verified: its verification.json names the original."""
    out = tmp_path_factory.mktemp("eval") / "tiny-mla"
    assert convert.gqa2mla(TINY_LLAMA, out, progress=False).passed
    return out


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def _one_error_line(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.slow
def test_eval_prints_the_table_original_first_and_exits_0(converted, tmp_path):
    out = tmp_path / "results.json"
    args = ["eval", str(converted), "--limit", "2", "--device", "cpu", "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "| task | metric | tiny-llama (original) | tiny-mla (mla) | ratio |" in result.stdout
    rows = [_cells(line) for line in result.stdout.splitlines() if line.startswith("| convert_")]
    assert [row[1] for row in rows] == [
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
        "acc",
        "acc_norm",
    ]
    assert [float(row[4]) for row in rows[:2]] == pytest.approx([1, 1], abs=1e-5), rows  # the exact conversion
    saved = json.loads(out.read_text())
    assert [m["role"] for m in saved["models"]] == ["original", "converted"]
    assert saved["models"][0]["path"] == str(TINY_LLAMA) and saved["limit"] == 2


@pytest.mark.slow
def test_an_unknown_task_exits_2_naming_it(converted, monkeypatch):
    """Checked once lm_eval has indexed its own catalogue too (~20 s), before any model is loaded and
    before the command's opening line (here due at once): the refusal is the only line."""
    monkeypatch.setattr(convert.progress, "FIRST", 0.01)
    result = CliRunner().invoke(main, ["eval", str(converted), "--tasks", "convert_ppl,no_such_task"])
    line = _one_error_line(result, 2)
    assert "--tasks no_such_task" in line and "convert_ppl, convert_mc" in line


def test_a_missing_directory_exits_2_before_torch_in_the_apis_words(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ConvertError) as api:
        evaluate([missing], ["convert_ppl"])
    code = (
        "import sys; from cli import main\n"
        f"sys.argv = ['convert', 'eval', {str(missing)!r}]\n"
        "try:\n    main()\nexcept SystemExit as stop:\n"
        "    print('torch' in sys.modules); sys.exit(stop.code)"
    )
    env = {k: v for k, v in os.environ.items() if k != convert.LIGHT_IMPORT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 2 and done.stdout.strip() == "False", (done.stdout, done.stderr)
    assert done.stderr == f"error: {api.value}\n"


def test_an_output_in_a_missing_directory_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(TINY_LLAMA), "-o", str(tmp_path / "nowhere" / "r.json")])
    assert "--output" in _one_error_line(result, 2)


def test_a_conversion_without_a_report_needs_original(tmp_path):
    convert.gqa2mla(TINY_LLAMA, tmp_path / "mla", verify=False, progress=False)
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "mla")])
    assert "pass --original PATH" in _one_error_line(result, 2)


def test_without_lm_eval_exits_3_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    monkeypatch.setattr(convert.progress, "FIRST", 0.01)  # the opening line, due at once, follows the check
    result = CliRunner().invoke(main, ["eval", str(TINY_LLAMA)])
    assert "pip install 'convert[eval]'" in _one_error_line(result, 3)
