"""The README is what users run: every example in it runs as written here (the Quick start's two
commands in `.ci/run`), its times are what `bench/readme_examples.py` measured, its exit-code table
is the CLI's; docs/design.md names every module and bench/README.md every script."""

import json
import re

import pytest
import readme_examples as rx

from convert.cli import EXIT_CODES

from conftest import CONVERT_STDERR_LINE, REPO

README = (REPO / "README.md").read_text()
TIMINGS = REPO / "bench" / "results" / "readme_examples" / "readme_examples.json"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _kind(kind: str) -> list[rx.Example]:
    return [e for e in rx.examples() if e.kind == kind]


def test_every_code_block_is_an_example_with_a_kind():
    assert not rx.unmarked_blocks(), f"README code blocks at lines {rx.unmarked_blocks()} have no example marker"
    found = rx.examples()
    assert {e.kind for e in found} <= set(rx.KINDS), [e.kind for e in found]
    assert all(e.why for e in found if e.kind == "manual"), "a manual example must say what it needs"
    assert len(_kind("fast")) >= 1 and len(_kind("real")) >= 4


def test_the_marker_parser_sees_unmarked_blocks():
    text = "<!-- example: fast -->\n```bash\n# ~1 s\necho hi\n```\n\n```python\nprint(1)\n```\n"
    assert [e.code for e in rx.examples(text)] == ["# ~1 s\necho hi\n"]
    assert rx.unmarked_blocks(text) == [7]


def test_ci_runs_the_two_quick_start_commands_verbatim():
    commands = [e.code.strip() for e in _kind("ci")]
    assert len(commands) == 2, commands
    assert all(e.code in _section(README, "Quick start") for e in _kind("ci"))
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"{command!r} is not a line of .ci/run"


def test_readme_times_are_the_benchmarks():
    """Each fast/real example's stated time is what bench/readme_examples.py measured for that code."""
    measured = {row["code"]: row for row in json.loads(TIMINGS.read_text())["examples"]}
    for example in _kind("fast") + _kind("real"):
        assert example.stated_time, f"README line {example.line}: the example's first line must be '# ~N s'"
        row = measured.get(example.body)
        assert row is not None, f"README line {example.line}: not measured; run python bench/readme_examples.py"
        assert example.stated_time == rx.format_time(row["seconds"]), (example.line, row["seconds"])


@pytest.mark.slow
def test_fast_examples_run_as_written(tmp_path):
    env = rx.prepare(tmp_path)
    for example in _kind("fast"):
        rx.run(example, tmp_path, env, timeout=600)


@pytest.mark.realdata
@pytest.mark.slow
def test_real_model_examples_run_as_written(smollm2, tmp_path):
    """In order, in one directory, exactly as the README shows them: each exits 0 (a FAIL is exit 1)."""
    env = rx.prepare(tmp_path)
    runs = {example.body: rx.run(example, tmp_path, env, timeout=1800) for example in _kind("real")}
    assert any("PASS" in output for _, output, _ in runs.values())
    assert (tmp_path / "smollm2-kv50-healed" / "healing.json").is_file()
    # what a new user meets (issue 36): stderr holds only convert's own lines
    for body, (_, _, stderr) in runs.items():
        if body.startswith("convert "):
            assert not [line for line in stderr.splitlines() if not CONVERT_STDERR_LINE.match(line)], (body, stderr)
    # the 135M model gets the whole check, greedy generation included, on a machine with room for it
    verify = next(output for body, (_, output, _) in runs.items() if body.startswith("convert verify"))
    assert "greedy continuation identical: " in verify and "identical: not run" not in verify, verify
    # one KV-cache figure: the compressed output's summary says what the README's table says
    compressed = next(output for body, (_, output, _) in runs.items() if "--kv-cache-ratio 0.5" in body)
    after = re.search(r"KV cache per token: \d+ B \(GQA\) -> (\d+) B", compressed).group(1)
    row = next(line for line in README.splitlines() if line.startswith("| `--layout factored --kv-cache-ratio 0.5`"))
    assert f"{int(after):,} B" in row, (after, row)


def test_readme_is_for_users():
    assert len(README.splitlines()) <= 250
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", README), (
        "commit hashes belong in the CHANGELOG or git log"
    )


def test_design_doc_names_every_module():
    layout = _section((REPO / "docs" / "design.md").read_text(), "Layout of the code")
    modules = sorted(
        p.relative_to(REPO).as_posix() for p in (REPO / "convert").rglob("*.py") if p.name != "__init__.py"
    )
    missing = [m for m in modules if m not in layout]
    assert not missing, f"docs/design.md 'Layout of the code' does not name {missing}"
    assert "cli.py" in layout.replace("convert/cli.py", "")  # the top-level entry point too


@pytest.mark.parametrize("doc", sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_docs_name_only_what_exists(doc):
    """The reverse (issue 68): each file, folder and module a doc names is there (docs/design.md named
    `targets/deepseek.py` long after that became a package)."""
    import importlib

    text = (REPO / "docs" / doc).read_text()
    roots = ("convert", "bench", "fixtures", "tests", "scripts", "docs")
    paths = set(re.findall(rf"`((?:{'|'.join(roots)})/[\w/.-]*)`", text))
    missing = [p for p in sorted(paths) if not (REPO / p).exists()]
    files = set(re.findall(r"`([\w-]+\.py)`", text))
    tree = [p for root in roots for p in (REPO / root).rglob("*")]
    everywhere = {p.name for p in tree if p.suffix == ".py" or p.is_dir()}
    missing += [f for f in sorted(files) if f not in everywhere]
    for dotted in sorted(set(re.findall(r"`(convert(?:\.\w+)+)`", text))):
        module, _, attribute = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
        except ModuleNotFoundError:
            if not hasattr(importlib.import_module(module), attribute):
                missing.append(dotted)
    assert not missing, f"docs/{doc} names what is not in the tree: {missing}"


def test_bench_readme_lists_every_script():
    listed = (REPO / "bench" / "README.md").read_text()
    scripts = sorted(p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
    missing = [s for s in scripts if f"`{s}`" not in listed]
    assert not missing, f"bench/README.md does not list {missing}"


def test_exit_code_table_is_the_clis():
    table = README[README.index("### Exit codes") :]
    readme_codes = re.findall(r"^\| (\d+) \|", table, flags=re.M)
    cli_codes = re.findall(r"^\s+(\d+)\s{2,}", EXIT_CODES, flags=re.M)
    assert readme_codes == cli_codes == ["0", "1", "2", "3", "4", "130"]


def _ignored(name: str, patterns: list[str]) -> bool:
    """Whether .gitignore's `patterns` ignore the directory `name` at the repository's root (the
    forms this .gitignore uses: `/name/`, `glob/`, `/glob-*/`)."""
    from fnmatch import fnmatch

    return any(fnmatch(name, p.strip("/")) for p in patterns if p.endswith("/"))


def test_every_example_output_is_ignored_by_git_and_the_readme_says_how_to_remove_it():
    """What the examples write in the checkout (-o DIRs, heal's <DIR>-healed and its -training logs,
    the Trainer's output_dir, save_pretrained's, data/) is ignored by git, and the README's removal command covers it."""
    code = "\n".join(e.body for e in rx.examples() if e.kind in ("ci", "fast", "real"))
    written = set(re.findall(r"-o (\S+)", code)) | set(re.findall(r'gqa2mla\("[^"]+", "([^"]+)"', code))
    written |= set(re.findall(r'TrainingArguments\("([^"]+)"', code)) | {"data"}
    written |= set(re.findall(r'save_pretrained\("([^"]+)"', code))
    healed = re.findall(r"convert heal (\S+)", code)
    written |= {f"{d}-healed" for d in healed} | {f"{d}-healed-training" for d in healed}
    assert {"smollm2-kv50-healed-training", "tiny-mla-trainer", "tiny-absorbed-trained", "smollm2-vllm"} <= written
    patterns = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines() if line.strip()]
    assert not [d for d in written if not _ignored(d, patterns)], "not ignored by .gitignore"
    removal = re.search(r"`rm -rf ([^`]+)`", README).group(1).split()
    from fnmatch import fnmatch

    assert not [d for d in written if not any(fnmatch(d, p) for p in removal)], removal
    assert "~/.cache/convert-fixtures" in removal
