"""Shared machinery of the fuzz tests (tests/*/test_fuzz_*.py): damaged inputs end in one clean
line and exit code, never in a traceback or a false success.

Seeded and reproducible. Every case is classified before it runs:
- "refuse": the input is inconsistent (a broken header, a field of the wrong type, a
  config that does not describe the tensors): `convert gqa2mla` must exit 2 with one
  `error:` line and leave nothing on disk;
- "pass": the mutation leaves an equivalent input (keys reordered, whitespace, unicode
  escapes, a field restated with its default): the conversion must succeed;
- "either": the input is self-consistent but a different model (a valid rope_theta,
  the data of two same-shaped tensors swapped): both outcomes are fine.
Damaged converted directories (`convert verify`) must never PASS: exit 2 (refused) or
exit 1 (FAIL), never 0. Any exception other than those exits counts as a traceback.

Cases run in-process through click's CliRunner; a few go through `python -m convert`.
Counts are printed (`pytest -s` shows them) and asserted.

A test module uses the fixtures here by binding them to its own names (`one_thread =
fuzzing.one_thread`): `one_thread` (autouse) in every one, `converted` where a converted
directory is needed.
"""

import json
import os
import shutil
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from convert.cli import main

from conftest import TINY_LLAMA

SEED = 20250612

RAW = (TINY_LLAMA / "model.safetensors").read_bytes()
HEADER_LEN = struct.unpack("<Q", RAW[:8])[0]
HEADER = json.loads(RAW[8 : 8 + HEADER_LEN])
DATA = RAW[8 + HEADER_LEN :]
CONFIG = json.loads((TINY_LLAMA / "config.json").read_text())
NAMES = [n for n in HEADER if n != "__metadata__"]
ATTENTION = [n for n in NAMES if ".self_attn." in n]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is ~20x faster than several fighting over a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    """One mutated input: its family, how it must end, and what was done (for failure messages)."""

    kind: str
    expect: str  # "refuse", "pass" or "either"; converted directories: "refuse" or "fail" (exit 1)
    what: str
    payload: object = None  # the file bytes / config text / damage function


# ------------------------------------------------------------------ running and judging


def invoke(args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def outcome(result) -> tuple[str, str]:
    """('ok' | 'fail' | 'refused' | 'bad-message' | 'traceback', detail) of a CliRunner result."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "traceback", f"{type(result.exception).__name__}: {result.exception}"[:300]
    lines = result.stderr.strip().splitlines()
    if result.exit_code == 0:
        return "ok", ""
    if result.exit_code == 1:
        return "fail", result.output[-200:]
    if result.exit_code == 2:
        good = len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
        return ("refused" if good else "bad-message"), result.stderr[:300]
    return "traceback", f"exit {result.exit_code}: {result.output[-300:]}"


def _allowed(expect: str, got: str) -> bool:
    return {
        "refuse": got == "refused",
        "pass": got == "ok",
        "either": got in ("ok", "refused"),
        "fail": got == "fail",
    }[expect]


class Tally:
    """Outcomes per family and expectation; every case that broke a rule, with why."""

    def __init__(self, title: str):
        self.title, self.counts, self.broken = title, Counter(), []

    def record(self, case: Case, got: str, detail: str, leftovers: list[str]) -> None:
        self.counts[(case.kind, case.expect, got)] += 1
        if not _allowed(case.expect, got) or leftovers:
            self.broken.append(f"{case.kind} [{case.what}] expected {case.expect}, got {got} {detail} {leftovers}")

    def total(self, got: str | None = None, expect: str | None = None) -> int:
        return sum(n for (_, e, g), n in self.counts.items() if (got in (None, g)) and (expect in (None, e)))

    def report(self) -> None:
        print(f"\n{self.title}: {self.total()} cases")
        by_outcome, kinds = Counter(), Counter()
        for (kind, expect, got), n in self.counts.items():
            by_outcome[expect, got] += n
            kinds[kind] += n
        for expect in ("refuse", "pass", "either", "fail"):
            line = ", ".join(f"{g} {n}" for (e, g), n in sorted(by_outcome.items()) if e == expect)
            if line:
                print(f"  expected {expect:8s}: {line}")
        print("  families: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        print(f"  tracebacks: {self.total('traceback')}, broken rules: {len(self.broken)}")

    def check(self, minimum: int) -> None:
        assert self.total() >= minimum
        assert self.total("traceback") == 0, self.broken[:10]
        assert self.broken == [], f"{len(self.broken)} cases broke a rule:\n" + "\n".join(self.broken[:15])


def run_conversion(case: Case, work: Path, tally: Tally) -> None:
    """Convert work/src into work/out; judge the outcome and what is left beside the output."""
    out = work / "out"
    got, detail = outcome(invoke(["gqa2mla", work / "src", "-o", out, "--no-verify", "-q"]))
    expected_listing = {"src", "out"} if got == "ok" else {"src"}
    leftovers = sorted(set(os.listdir(work)) ^ expected_listing)
    tally.record(case, got, detail, leftovers)
    shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------ safetensors headers


def pack(text: bytes, data: bytes = DATA) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


def dump(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


# ------------------------------------------------------------------ converted directories


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """One conversion of the tiny Llama, sharded (5 files + index) so the index can be damaged too."""
    out = tmp_path_factory.mktemp("converted") / "tiny-mla"
    torch.set_num_threads(1)
    result = invoke(["gqa2mla", TINY_LLAMA, "-o", out, "--no-verify", "-q", "--max-shard-size", "100KB"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").is_file()
    return out


def read_json(path: Path):
    return json.loads(path.read_text())


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def edit_config(fn):
    def damage(d: Path) -> None:
        config = read_json(d / "config.json")
        fn(config)
        write_json(d / "config.json", config)

    return damage


def set_config(*path_and_value):
    """Set config[path...] = value (a missing last key is added; `DROP` removes it)."""
    *path, value = path_and_value

    def edit(config):
        target = config
        for key in path[:-1]:
            target = target[key]
        if value is DROP:
            target.pop(path[-1]) if isinstance(target, dict) else target.pop(path[-1])
        else:
            target[path[-1]] = value

    return edit_config(edit)


class _Drop:
    def __repr__(self) -> str:
        return "<removed>"


DROP = _Drop()
