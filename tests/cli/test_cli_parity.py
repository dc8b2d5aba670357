"""The CLI is built from the options dataclasses: every flag is one field, same defaults,
same choices, and what a flag says reaches the API unchanged."""

import dataclasses
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import convert.api
import convert.verify
from convert.cli import main
from convert.options import ConvertOptions, VerifyOptions

from conftest import REPO, TINY_LLAMA

# Command arguments that are API arguments, not options.
NOT_OPTIONS = {"gqa2mla": {"src", "output"}, "verify": {"original", "converted", "report_dir", "verbose"}}
COMMANDS = {"gqa2mla": ConvertOptions, "verify": VerifyOptions}


def _flag_fields(cls) -> list[dataclasses.Field]:
    """The fields that are flags (not those of the Python API alone, `cli=False`)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _params(command: str) -> dict[str, click.Parameter]:
    params = main.commands[command].params
    return {p.name: p for p in params if p.name not in NOT_OPTIONS[command]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_field_and_every_field_a_flag(command):
    fields = {f.name for f in _flag_fields(COMMANDS[command])}
    assert set(_params(command)) == fields


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_and_choices_match(command):
    params = _params(command)
    for f in _flag_fields(COMMANDS[command]):
        param = params[f.name]
        assert param.default == f.default, f.name
        if f.metadata["choices"]:
            assert tuple(param.type.choices) == tuple(f.metadata["choices"]), f.name
        assert param.help == f.metadata["help"], f.name


# One non-default value per field, as a CLI argument list and as the API value.
NON_DEFAULTS = {
    "text": (["--text", "t.txt"], Path("t.txt")),
    "tokens": (["--tokens", "17"], 17),
    "device": (["--device", "cpu"], "cpu"),
    "dtype": (["--dtype", "float32"], "float32"),
    "max_ppl_ratio": (["--max-ppl-ratio", "1.5"], 1.5),
    "max_memory": (["--max-memory", "8GiB"], "8GiB"),
    "e2e": (["--e2e", "streamed"], "streamed"),
    "progress": (["-q"], False),
    "target": (["--target", "transformers"], "transformers"),
    "gguf_type": (["--target", "llamacpp", "--gguf-type", "q8_0"], "Q8_0"),
    "latent_multiple": (["--target", "llamacpp", "--latent-multiple", "128"], 128),
    "arch": (["--arch", "llama"], "llama"),
    "n_heads": (["--n-heads", "4"], 4),
    "n_kv_heads": (["--n-kv-heads", "2"], 2),
    "head_dim": (["--head-dim", "8"], 8),
    "head_map": (["--head-map", "tiled"], "tiled"),
    "latent": (["--latent", "joint"], "joint"),
    "layout": (["--layout", "factored"], "factored"),
    "rank": (["--rank", "6"], 6),
    "kv_cache_ratio": (["--kv-cache-ratio", "0.5"], 0.5),
    "method": (["--method", "whitened"], "whitened"),
    "allocation": (["--allocation", "global"], "global"),
    "calib": (["--calib", "c.txt", "--calib", "d.jsonl"], [Path("c.txt"), Path("d.jsonl")]),
    "shrinkage": (["--shrinkage", "0.25"], 0.25),
    "calib_tokens": (["--calib-tokens", "99"], 99),
    "fisher_tokens": (["--fisher-tokens", "77"], 77),
    "nope_angle": (["--nope-angle", "1.5"], 1.5),
    "calibration": (["--calibration", "sequential"], "sequential"),
    "refine_steps": (["--refine-steps", "7"], 7),
    "refine_queries": (["--refine-queries", "128"], 128),
    "max_shard_size": (["--max-shard-size", "1GB"], "1GB"),
    "force": (["--force"], True),
    "verify": (["--no-verify"], False),
}


#: the other flags a flag is given with (it is refused alone)
NEEDS = {"gguf_type": {"target": "llamacpp"}, "latent_multiple": {"target": "llamacpp"}}


def test_the_table_above_covers_every_field():
    assert set(NON_DEFAULTS) == {f.name for f in _flag_fields(ConvertOptions)}


@pytest.mark.parametrize("name", sorted(NON_DEFAULTS))
def test_a_flag_reaches_the_api_as_its_field(monkeypatch, tmp_path, name):
    seen = {}

    def fake_gqa2mla(src, output=None, **options):
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(convert.api, "gqa2mla", fake_gqa2mla)
    args, value = NON_DEFAULTS[name]
    shutil.copytree(TINY_LLAMA, tmp_path / "src")  # a checkpoint: the CLI checks SRC before the API runs
    result = CliRunner().invoke(main, ["gqa2mla", str(tmp_path / "src"), *args])
    assert result.exit_code == 0, result.output
    assert seen[name] == value
    others = {f.name: f.default for f in _flag_fields(ConvertOptions) if f.name != name} | NEEDS.get(name, {})
    assert {k: seen[k] for k in others} == others


def test_verify_flags_reach_verify_paths(monkeypatch):
    seen = {}

    def fake_verify_paths(original, converted, **options):
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(convert.verify, "verify_paths", fake_verify_paths)
    args = [
        "--tokens",
        "17",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-ppl-ratio",
        "1.5",
        "--max-memory",
        "8GiB",
        "--e2e",
        "streamed",
        "-q",
    ]
    result = CliRunner().invoke(main, ["verify", "a", "b", *args])
    assert result.exit_code == 0, result.output
    assert seen == {
        "text": None,
        "tokens": 17,
        "device": "cpu",
        "dtype": "float32",
        "max_ppl_ratio": 1.5,
        "max_memory": "8GiB",
        "e2e": "streamed",
        "progress": False,
    }
    VerifyOptions.from_kwargs(**seen)  # and the API accepts exactly these names


def test_top_level_cli_py_is_the_same_command():
    import runpy

    namespace = runpy.run_path(str(REPO / "cli.py"), run_name="not_main")
    assert namespace["main"] is main
