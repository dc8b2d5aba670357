"""The README is what users run: its two commands are what CI runs, its layout section
names every module, its exit-code table is the CLI's."""

import re
from pathlib import Path

from convert.cli import EXIT_CODES

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_ci_runs_the_two_quick_start_commands_verbatim():
    commands = re.findall(r"```bash\n(.+?)\n```", _section("Quick start"), flags=re.S)
    assert len(commands) == 2, commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"{command!r} is not a line of .ci/run"


def test_layout_section_names_every_module():
    layout = _section("Layout of the code")
    modules = sorted(
        p.relative_to(REPO).as_posix() for p in (REPO / "convert").rglob("*.py") if p.name != "__init__.py"
    )
    missing = [m for m in modules if m not in layout]
    assert not missing, f"README 'Layout of the code' does not name {missing}"
    assert "cli.py" in layout.replace("convert/cli.py", "")  # the top-level shim too


def test_exit_code_table_is_the_clis():
    table = README[README.index("### Exit codes") :]
    readme_codes = re.findall(r"^\| (\d+) \|", table, flags=re.M)
    cli_codes = re.findall(r"^\s+(\d+)\s{2,}", EXIT_CODES, flags=re.M)
    assert readme_codes == cli_codes == ["0", "1", "2", "3", "130"]
