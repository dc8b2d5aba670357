"""bench/results/ holds results only, one folder per bench, and every result the docs name is there."""

import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
RESULT_SUFFIXES = {".json", ".png", ".txt", ".log"}
#: where results are named: the docs, the benches' own help and docstrings, the fixtures
NAMING = ["README.md", "CHANGELOG.md", "bench/README.md", "docs/*.md", "bench/*.py", "fixtures/*.py"]
#: a path to a result (up to a space, quote or bracket; a sentence's full stop is not part of it)
NAMED = re.compile(r"bench/results/[^\s`'\"()]*")
#: placeholders (<model>, MODEL, KIND, *, {name}) and the git-ignored *.tmp: not one file
PATTERN = re.compile(r"[<>*{}\[\]]|MODEL|KIND|\.tmp\b")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def _tracked_results() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "bench/results"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [REPO / f for f in listed]


def test_bench_results_holds_results_only_in_one_folder_per_bench():
    tracked = _tracked_results()
    assert tracked, "bench/results/ tracks nothing"
    benches = {p.stem for p in (REPO / "bench").glob("*.py")}
    for path in tracked:
        rel = path.relative_to(RESULTS)
        assert path.suffix in RESULT_SUFFIXES, f"{rel}: not a result (code goes in bench/, named by commit in docs/)"
        assert len(rel.parts) > 1 and rel.parts[0] in benches, f"{rel}: not in the folder of the bench that wrote it"


def _named(repo: Path = REPO) -> list[tuple[str, str, str]]:
    """(file, path, its surroundings) for every bench/results path the naming files spell out."""
    found = []
    for pattern in NAMING:
        for file in sorted(repo.glob(pattern)):
            text = file.read_text(encoding="utf-8")
            for match in NAMED.finditer(text):
                path = match.group(0).rstrip(".,;:")
                if PATTERN.search(path):
                    continue
                around = text[max(0, match.start() - 200) : match.end() + 200]
                found.append((str(file.relative_to(repo)), path, around))
    return found


def _missing(named: list[tuple[str, str, str]], repo: Path = REPO) -> list[str]:
    """The named results not in the tree, but for past code named with the commit that holds it."""
    return [
        f"{file}: {path}" for file, path, around in named if not (repo / path).exists() and not COMMIT.search(around)
    ]


def test_every_result_the_docs_name_exists():
    named = _named()
    assert len(named) > 100, "the pattern finds the docs' results"
    missing = _missing(named)
    assert not missing, "named but not in the tree:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_result_and_lets_past_code_named_by_commit_be(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(
        "measured in `bench/results/compression/no_such_run.json`, `bench/results/heal/<model>.json`.\n"
        + "x " * 200
        + "\nby `python bench/results/refine_lr/driver.py` in a checkout of 57c41f4.\n"
    )
    named = _named(tmp_path)
    assert [p for _, p, _ in named] == [
        "bench/results/compression/no_such_run.json",
        "bench/results/refine_lr/driver.py",
    ]
    assert _missing(named, tmp_path) == ["docs/x.md: bench/results/compression/no_such_run.json"]


def _names(data, key: str) -> bool:
    """Whether `key` is in `data` or in any dict inside it (a merged table's rows each name their own run)."""
    if isinstance(data, dict):
        return key in data or any(_names(v, key) for v in data.values())
    if isinstance(data, list):
        return any(_names(v, key) for v in data)
    return False


def test_every_json_result_names_the_command_and_the_commit_that_made_it():
    results = [p for p in _tracked_results() if p.suffix == ".json"]
    assert results
    for path in results:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(data, dict) and data.get("commit"), f"{path.relative_to(REPO)}: no commit"
        assert _names(data, "command"), f"{path.relative_to(REPO)}: no command"
