"""The command line answers at once: --help, --version, usage errors and the refusals
that need no tensor import neither torch nor transformers (each run in a fresh
process through the entry point setup.cfg installs), while `import convert` still
registers `convert_mla` with transformers' Auto classes. Timings: bench/cli_startup.py."""

import configparser
import os
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import convert
import convert.api
from convert.arch import ARCHS
from convert.cli import COMMAND_EXIT_CODES, main
from convert.errors import ConvertError

from conftest import REPO, TINY_LLAMA


def _entry_point(name: str = "convert") -> str:
    """`module:function` of a console script, as setup.cfg declares it."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(line.replace(" ", "").split("=") for line in lines)[name]


# Runs the entry point in a fresh interpreter, then prints which heavy modules it imported.
CHILD = """
import importlib, sys
module, function = sys.argv[1].split(":")
sys.argv = ["convert", *sys.argv[2:]]
try:
    getattr(importlib.import_module(module), function)()
except SystemExit as stop:
    code = stop.code
heavy = [name for name in ("torch", "transformers") if name in sys.modules]
print("heavy imports:", ",".join(heavy) or "none")
sys.exit(code)
"""


def _run_entry_point(*args, entry: str = "convert") -> tuple[int, str, str, str]:
    """(exit code, stdout, stderr, the heavy modules it imported) of `convert ARGS` in a new process."""
    env = {k: v for k, v in os.environ.items() if k != convert.LIGHT_IMPORT}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, _entry_point(entry), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    out, _, marker = done.stdout.rstrip("\n").rpartition("\n")
    assert marker.startswith("heavy imports: "), (done.stdout, done.stderr)
    return done.returncode, out, done.stderr, marker.removeprefix("heavy imports: ")


def test_the_entry_points_are_the_top_level_cli_module():
    assert _entry_point("convert") == _entry_point("convert-mla") == "cli:main"  # cli.py: see its docstring


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"], ["gqa2mla", "--help"], ["verify", "-h"], ["heal", "--help"], ["eval", "--help"]],
    ids=lambda args: " ".join(args),
)
def test_help_and_version_import_no_torch(args):
    code, out, err, heavy = _run_entry_point(*args)
    assert code == 0, err
    assert heavy == "none"
    assert out.strip() and not err


@pytest.mark.parametrize(
    "args, names",
    [
        (["gqa2mla", "--bogus-flag"], ["--bogus-flag"]),
        (["gqa2mla"], ["SRC"]),
        (["gqa2mla", TINY_LLAMA, "--layout", "diagonal"], ["--layout", "diagonal"]),
        (["gqa2mla", TINY_LLAMA, "--arch", "gpt2"], ["--arch", "gpt2"]),
        (["gqa2mla", TINY_LLAMA, "--tokens", "x"], ["--tokens"]),
        (["heal", "converted"], ["--text"]),
    ],
    ids=["unknown flag", "missing argument", "bad choice", "unknown arch", "not a number", "missing option"],
)
def test_usage_errors_import_no_torch(args, names):
    code, _, err, heavy = _run_entry_point(*args)
    assert code == 2, err
    assert heavy == "none"
    assert all(str(name) in err for name in names), err


@pytest.mark.parametrize(
    "args, names",
    [
        (["gqa2mla", "/nonexistent/model"], ["/nonexistent/model", "no such file"]),
        (["gqa2mla", TINY_LLAMA, "--tokens", "1"], ["--tokens 1"]),
        (["gqa2mla", TINY_LLAMA, "--max-ppl-ratio", "-1"], ["--max-ppl-ratio -1"]),
        (["gqa2mla", TINY_LLAMA, "--kv-cache-ratio", "2"], ["--kv-cache-ratio 2"]),
        (["gqa2mla", TINY_LLAMA, "--rank", "0"], ["--rank 0"]),
        (["gqa2mla", TINY_LLAMA, "--target", "vllm", "--layout", "factored"], ["--layout", "--target mla"]),
        (["verify", TINY_LLAMA, TINY_LLAMA, "--tokens", "1"], ["--tokens 1"]),
        (["heal", TINY_LLAMA, "--text", "t.txt", "--steps", "0"], ["--steps 0"]),
        (["gqa2mla", TINY_LLAMA, "-o", "fixtures"], ["output fixtures", "input"]),
        (["gqa2mla", TINY_LLAMA, "-o", "README.md"], ["output README.md", "choose another -o"]),
    ],
    ids=[
        "missing source",
        "tokens",
        "ppl ratio",
        "cache ratio",
        "rank",
        "export flags",
        "verify",
        "heal",
        "output around the input",
        "output not convert's",
    ],
)
def test_refusals_that_need_no_tensor_import_no_torch(args, names):
    code, out, err, heavy = _run_entry_point(*args)
    assert code == 2, err
    assert heavy == "none"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(name in lines[0] for name in names), lines[0]
    assert not out


def test_the_missing_source_line_is_the_apis(tmp_path):
    """The CLI refuses a missing source before importing the reader, in the reader's words."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConvertError) as api:
        convert.api.gqa2mla(missing, tmp_path / "out")
    result = CliRunner().invoke(main, ["gqa2mla", str(missing), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr == f"error: {api.value}\n"


@pytest.mark.parametrize("kind", ["not safetensors", "no weights", "already converted"])
def test_a_source_that_is_no_gqa_checkpoint_is_refused_before_torch(kind, tmp_path):
    """A file that is no checkpoint, a directory without weights, or convert's own output: refused
    at once (no torch import), in one line naming what it is, as the API refuses it."""
    if kind == "not safetensors":
        src = tmp_path / "model.safetensors"
        src.write_text("hello")
    elif kind == "no weights":
        src = tmp_path / "empty"
        src.mkdir()
    else:
        src = tmp_path / "mla"
        convert.api.gqa2mla(TINY_LLAMA, src, verify=False, progress=False)
    code, out, err, heavy = _run_entry_point("gqa2mla", src, "-o", tmp_path / "out")
    assert code == 2 and heavy == "none" and not out, err
    words = {"not safetensors": "not a safetensors file", "no weights": "no .safetensors files"}
    expected = words.get(kind, "already converted to MLA (by convert ")
    assert err.count("\n") == 1 and expected in err, err
    with pytest.raises(ConvertError, match=re.escape(expected)):
        convert.api.gqa2mla(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused():
    code, _, err, _ = _run_entry_point("gqa2mla", TINY_LLAMA, "--device", "cuda")
    assert code == 2 and err.startswith("error: --device cuda: no CUDA device"), err


@pytest.mark.slow
def test_a_conversion_through_the_light_entry_point(tmp_path):
    """The commands import the API (and register `convert_mla`, which verification loads through)."""
    code, out, err, heavy = _run_entry_point("gqa2mla", TINY_LLAMA, "-o", tmp_path / "out", "-q")
    assert code == 0, err
    assert heavy == "torch,transformers"
    assert (tmp_path / "out" / "verification.json").is_file()


def _fresh_python(code: str, light: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != convert.LIGHT_IMPORT}
    if light:
        env[convert.LIGHT_IMPORT] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


REGISTERED = (
    "from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
    "from transformers import AutoModelForCausalLM; "
    "print(CONFIG_MAPPING['convert_mla'] is convert.MLAConfig, "
    "AutoModelForCausalLM._model_mapping[convert.MLAConfig] is convert.MLAForCausalLM)"
)


def test_import_convert_registers_the_model_type():
    assert _fresh_python("import convert; " + REGISTERED) == ["True", "True"]


@pytest.mark.slow
def test_a_light_import_registers_on_first_use():
    code = "import sys, convert; print('torch' in sys.modules); convert.gqa2mla; " + REGISTERED
    assert _fresh_python(code, light=True) == ["False", "True", "True"]


def test_cli_py_names_the_packages_switch():
    assert f'"{convert.LIGHT_IMPORT}"' in (REPO / "cli.py").read_text()


# ------------------------------------------------------------------ --help


def _help(*command: str) -> str:
    result = CliRunner().invoke(main, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def test_gqa2mla_help_is_ordered_by_what_people_reach_for_first():
    text = _help("gqa2mla")
    sections = ["Input and output:", "Layout (exact):", "Compression", "Verification:", "Target:", "Advanced:"]
    flags = ["--output", "--layout", "--kv-cache-ratio", "--rank", "--method", "--calib", "--text", "--tokens"]
    flags += ["--max-ppl-ratio", "--target", "--arch", "--max-shard-size"]
    where = [text.index(title) for title in sections]
    assert where == sorted(where), sections
    where = [re.search(rf"^  (-\w, )?{flag} ", text, flags=re.M).start() for flag in flags]
    assert where == sorted(where), flags


def test_lossy_options_say_what_they_need():
    text = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(_help("gqa2mla").split()))  # a flag broken at its hyphen
    ratio = text[text.index("--kv-cache-ratio FLOAT") : text.index("--rank INTEGER")]
    for need in ("--calib", "the shipped mix", "--max-ppl-ratio", "--no-verify"):
        assert need in ratio, need


def test_arch_help_lists_the_registry():
    text = " ".join(_help("gqa2mla").split())
    assert f"--arch [{'|'.join(ARCHS)}]" in text


def test_target_help_is_short():
    text = _help("gqa2mla")
    target = text[text.index("  --target") : text.index("Advanced:")]
    assert len(target.strip().splitlines()) <= 10, target


@pytest.mark.parametrize("command", COMMAND_EXIT_CODES)
def test_each_command_shows_its_own_exit_codes(command):
    table = _help(command).split("Exit codes:")[1]
    assert " ".join(table.split()) == " ".join(COMMAND_EXIT_CODES[command].split("Exit codes:")[1].split())
    assert ("--no-verify" in table) == (command == "gqa2mla")
    assert ("FAIL" in table) == (command in ("gqa2mla", "verify"))
