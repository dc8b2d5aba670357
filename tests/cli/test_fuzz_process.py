"""Fuzzing through a real process: the fuzz tests' refusals (a relabelled header, a config
that does not describe the tensors, a converted directory of a newer format) from
`python -m convert`: exit 2, one `error:` line, nothing written (tests/fuzzing.py)."""

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fuzzing
import pytest
from fuzzing import ATTENTION, CONFIG, HEADER, dump, pack, set_config, write_json

from conftest import REPO, TINY_LLAMA

one_thread = fuzzing.one_thread  # autouse: the cases run on one torch thread
converted = fuzzing.converted  # the converted tiny Llama every damage starts from


def _subprocess_case(tmp_path: Path, name: str, args: list, setup) -> subprocess.Popen:
    work = tmp_path / name
    work.mkdir()
    setup(work)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "convert", *[str(a).format(work=work) for a in args]]
    return subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_refusals_through_a_real_process(tmp_path, converted):
    """The same refusals from `python -m convert`: exit 2, one `error:` line, nothing written.
    (Three processes started together: each spends most of its time importing torch and transformers.)"""

    def relabelled_header(work):
        shutil.copytree(TINY_LLAMA, work / "src")
        header = copy.deepcopy(HEADER)
        header[ATTENTION[0]]["dtype"] = "I32"  # same bytes: converted into zeros before
        (work / "src" / "model.safetensors").write_bytes(pack(dump(header)))

    def fewer_layers(work):
        shutil.copytree(TINY_LLAMA, work / "src")
        write_json(work / "src" / "config.json", {**CONFIG, "num_hidden_layers": 1})

    def newer_format(work):
        shutil.copytree(converted, work / "conv")
        set_config("mla", "format_version", 99)(work / "conv")

    convert_args = ["gqa2mla", "{work}/src", "-o", "{work}/out", "--no-verify", "-q"]
    verify_args = ["verify", TINY_LLAMA, "{work}/conv", "--dtype", "float32", "--tokens", "16", "-q"]
    cases = {
        "relabelled": (convert_args, relabelled_header, ATTENTION[0]),
        "fewer-layers": (convert_args, fewer_layers, "num_hidden_layers"),
        "newer-format": (verify_args, newer_format, "upgrade"),
    }
    running = {name: _subprocess_case(tmp_path, name, args, setup) for name, (args, setup, _) in cases.items()}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        print(f"\n{name}: exit {process.returncode}, {stderr.strip()}")
        assert process.returncode == 2, (name, stdout, stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and cases[name][2] in lines[0], stderr
        assert "Traceback" not in stderr
        assert sorted(os.listdir(tmp_path / name)) in (["src"], ["conv"]), os.listdir(tmp_path / name)
