"""The `convert gqa2mla` command line: bad input exits 2 with one line on stderr
naming the file/tensor/field and leaves nothing on disk; the happy path writes a
loadable, faithful output directory.

Every case passes --no-verify so it does not depend on the verification step.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert.cli import main

from conftest import EXACT_TOL, TINY_LLAMA, converted_attention, hf_inputs, reference_attention, rel_err

ATTN = "model.layers.{i}.self_attn.{p}.weight"


# ------------------------------------------------------------------ helpers


@pytest.fixture
def src(tmp_path) -> Path:
    """A private copy of the tiny Llama fixture that tests may damage."""
    path = tmp_path / "src"
    shutil.copytree(TINY_LLAMA, path)
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _resave(model_dir: Path, mutate) -> None:
    """Load the checkpoint's tensors, let `mutate` edit the dict, save it back."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _listing(directory: Path) -> set[str]:
    return set(os.listdir(directory))


def _convert_fails(tmp_path: Path, src_arg, *extra, must_name=(), out: Path | None = None):
    """Run a conversion that must be refused; check exit code, stderr and disk."""
    out = out or tmp_path / "out"
    before = _listing(out.parent)
    result = _run("gqa2mla", src_arg, "-o", out, "--no-verify", *extra)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {result.stderr!r}"
    line = lines[0]
    assert line.startswith("error: ")
    for name in must_name:
        assert str(name) in line, f"{name!r} not named in {line!r}"
    assert "Traceback" not in result.output
    # nothing created: no output directory, no temporary (.out.tmp-*) sibling
    assert _listing(out.parent) == before, _listing(out.parent) ^ before
    assert not any(".tmp-" in n or ".old-" in n for n in _listing(out.parent))
    return line


# ------------------------------------------------------------------ unreadable input


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    _convert_fails(tmp_path, missing, must_name=[missing])
    assert not (tmp_path / "out").exists()


def test_text_file_is_not_safetensors(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_text("this is not a checkpoint, just some text that is long enough\n" * 4)
    line = _convert_fails(tmp_path, bad, must_name=[bad])
    assert "safetensors" in line


def test_pickle_is_not_safetensors(tmp_path, src):
    (src / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    _convert_fails(tmp_path, src, must_name=["pytorch_model.bin"])
    _convert_fails(tmp_path, src / "pytorch_model.bin", must_name=[src / "pytorch_model.bin"])


def test_truncated_file(tmp_path, src):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    line = _convert_fails(tmp_path, src, must_name=[path])
    assert "truncated" in line


@pytest.mark.parametrize("damage", ["json", "field"])
def test_corrupt_header(tmp_path, src, damage):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + header_len]
    if damage == "json":
        i = header.index(b":")
        header[i : i + 1] = b";"  # same length: the file stays the same size
    else:
        i = header.index(b'"data_offsets"')
        header[i : i + 14] = b'"data_offsetZ"'
    data[8 : 8 + header_len] = header
    path.write_bytes(bytes(data))
    line = _convert_fails(tmp_path, src, must_name=[path])
    assert "corrupt" in line


# ------------------------------------------------------------------ inconsistent model


def test_heads_not_divisible(tmp_path, src):
    _edit_config(src, num_key_value_heads=3)  # H = 4
    _convert_fails(tmp_path, src, must_name=["n_heads=4", "n_kv_heads=3", "num_key_value_heads"])


@pytest.mark.parametrize("layer", [0, 1])
def test_layer_missing_k_proj(tmp_path, src, layer):
    name = ATTN.format(i=layer, p="k_proj")
    _resave(src, lambda t: t.pop(name))
    _convert_fails(tmp_path, src, must_name=[name])


def test_config_head_dim_contradicts_shapes(tmp_path, src):
    _edit_config(src, head_dim=8)  # q_proj has 4·16 rows
    _convert_fails(tmp_path, src, must_name=[ATTN.format(i=0, p="q_proj"), "head_dim"])


def test_config_hidden_size_contradicts_shapes(tmp_path, src):
    _edit_config(src, hidden_size=48)
    _convert_fails(tmp_path, src, must_name=["hidden_size=48"])


def test_float8_checkpoint_is_refused_naming_the_fix(tmp_path, src):
    """A float8 checkpoint (safetensors F8_E4M3) is quantized: refused before anything is computed, not
    an internal error of the first reduction over it."""
    _resave(src, lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()}))
    line = _convert_fails(tmp_path, src, must_name=["float8_e4m3fn", "dequantize"])
    assert ".q_proj.weight" in line or ".k_proj.weight" in line or "embed" in line, line


def test_tensor_shape_contradicts_config(tmp_path, src):
    name = ATTN.format(i=1, p="v_proj")
    _resave(src, lambda t: t.__setitem__(name, t[name][:16].contiguous()))
    _convert_fails(tmp_path, src, must_name=[name])


@pytest.mark.parametrize("bad,proj,layer", [(float("nan"), "o_proj", 1), (float("inf"), "q_proj", 0)])
def test_non_finite_weight_found_mid_conversion(tmp_path, src, monkeypatch, bad, proj, layer):
    name = ATTN.format(i=layer, p=proj)

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] = bad

    _resave(src, poison)
    # record the writer's temporary directories: the error comes after writing started
    import convert.io.writer as writer

    made = []
    real_make_sibling = writer.make_sibling

    def recording_make_sibling(*args, **kwargs):
        made.append(real_make_sibling(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(writer, "make_sibling", recording_make_sibling)
    _convert_fails(tmp_path, src, must_name=[name])
    assert made, "the NaN/Inf should be found while converting, after the output was started"
    assert not any(p.exists() for p in made)


def test_qk_norm_model_type(tmp_path, src):
    _edit_config(src, model_type="qwen3")
    _convert_fails(tmp_path, src, must_name=["qwen3", "model_type"])


def test_qk_norm_tensor_in_llama(tmp_path, src):
    name = "model.layers.0.self_attn.q_norm.weight"
    _resave(src, lambda t: t.__setitem__(name, torch.ones(16)))
    _convert_fails(tmp_path, src, must_name=[name])


def test_unknown_architecture(tmp_path, src):
    _edit_config(src, model_type="gpt_neox")
    _convert_fails(tmp_path, src, must_name=["gpt_neox", "model_type"])


# ------------------------------------------------------------------ refused requests


def test_output_exists_without_force(tmp_path, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # not convert's (no manifest): refused with or without --force, never touched
    _convert_fails(tmp_path, src, must_name=[out, "did not write"], out=out)
    _convert_fails(tmp_path, src, "--force", must_name=[out, "did not write"], out=out)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_output_equals_input(tmp_path, src):
    before = sorted(os.listdir(src))
    _convert_fails(tmp_path, src, must_name=[src], out=src)
    assert sorted(os.listdir(src)) == before


def test_output_contains_input(tmp_path, src):
    _convert_fails(tmp_path, src / "model.safetensors", must_name=[src], out=src)
    _convert_fails(tmp_path, src, "--force", must_name=[tmp_path], out=tmp_path)
    assert (src / "model.safetensors").is_file()


@pytest.mark.parametrize("rank", ["0", "-3"])
def test_rank_not_positive(tmp_path, src, rank):
    _convert_fails(tmp_path, src, "--rank", rank, must_name=["--rank", rank])


def test_rank_above_exact(tmp_path, src):
    # tiny Llama: G·d = 2·16 = 32 is the exact key rank
    _convert_fails(tmp_path, src, "--rank", "33", must_name=["--rank 33", "32"])


def test_odd_rank_with_rope_absorbed(tmp_path, src):
    # every frequency rotary (--nope-angle 0): the key latent is whole RoPE pairs
    _convert_fails(tmp_path, src, "--rank", "7", "--nope-angle", "0", must_name=["--rank 7"])


# ------------------------------------------------------------------ happy path


class _Converted(dict):
    config: dict


def _read_output(out: Path) -> _Converted:
    index = out / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors = _Converted()
    for name in files:
        tensors.update(load_file(out / name))
    tensors.config = json.loads((out / "config.json").read_text())
    return tensors


def _raw_bytes(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes() for name in f.keys()}


def test_happy_path(tmp_path, tiny_llama_dir):
    out = tmp_path / "x"
    result = _run("gqa2mla", tiny_llama_dir, "-o", out, "--no-verify", "-q")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stderr == ""
    assert out.is_dir() and not any(n.startswith(".") for n in os.listdir(tmp_path))

    converted = _read_output(out)
    config = converted.config
    source_config = json.loads((tiny_llama_dir / "config.json").read_text())
    # the source's fields under convert's own model type (the source's is kept in mla)
    assert config["model_type"] == "convert_mla" and config["mla"]["source_model_type"] == source_config["model_type"]
    kept = ("mla", "model_type", "architectures")
    assert {k: v for k, v in config.items() if k not in kept} == {
        k: v for k, v in source_config.items() if k not in kept
    }
    mla = config["mla"]
    assert mla["layout"] == "absorbed" and mla["latent"] == "split" and mla["head_map"] == "grouped"
    assert len(mla["layers"]) == source_config["num_hidden_layers"]
    assert (out / "generation_config.json").read_bytes() == (tiny_llama_dir / "generation_config.json").read_bytes()

    # non-attention tensors are bit-identical, attention tensors are replaced
    original = _raw_bytes(tiny_llama_dir / "model.safetensors")
    written = _raw_bytes(out / "model.safetensors")
    passthrough = [n for n in original if ".self_attn." not in n]
    assert passthrough and all(written[n] == original[n] for n in passthrough)
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for n in written)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata().get("format") == "pt"

    # and the written attention is the model's attention (float32 round-off)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    inputs = hf_inputs(model)
    for layer in range(2):
        ref = reference_attention(model, layer, inputs)
        assert rel_err(converted_attention(converted, layer, inputs, torch.float32), ref) <= EXACT_TOL[torch.float32]


def test_sharded_output(tmp_path, tiny_llama_dir):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert _run("gqa2mla", tiny_llama_dir, "-o", single, "--no-verify", "-q").exit_code == 0
    result = _run("gqa2mla", tiny_llama_dir, "-o", sharded, "--no-verify", "-q", "--max-shard-size", "20KB")
    assert result.exit_code == 0, (result.output, result.exception)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    a, b = _read_output(single), _read_output(sharded)
    assert set(a) == set(b) == set(index["weight_map"])
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a.config == b.config


def test_force_replaces(tmp_path, tiny_llama_dir):
    out = tmp_path / "x"
    assert _run("gqa2mla", tiny_llama_dir, "-o", out, "--no-verify", "-q").exit_code == 0
    again = _run("gqa2mla", tiny_llama_dir, "-o", out, "--no-verify", "-q")
    assert again.exit_code == 2 and "--force" in again.stderr
    # a file a person added means the directory is in use: --force refuses and keeps it
    (out / "notes.txt").write_text("mine")
    refused = _run("gqa2mla", tiny_llama_dir, "-o", out, "--no-verify", "-q", "--force")
    assert refused.exit_code == 2 and "notes.txt" in refused.stderr
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    forced = _run("gqa2mla", tiny_llama_dir, "-o", out, "--no-verify", "-q", "--force", "--layout", "factored")
    assert forced.exit_code == 0, (forced.output, forced.exception)
    assert json.loads((out / "config.json").read_text())["mla"]["layout"] == "factored"
    assert sorted(os.listdir(tmp_path)) == ["x"]  # no .x.old-* or .x.tmp-* left


def test_summary_when_not_quiet(tmp_path, tiny_llama_dir):
    result = _run("gqa2mla", tiny_llama_dir, "-o", tmp_path / "x", "--no-verify")
    assert result.exit_code == 0
    assert "KV cache per token" in result.stdout


def test_python_m_convert_help():
    result = subprocess.run(
        [sys.executable, "-m", "convert", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TINY_LLAMA.parent.parent,
    )
    assert result.returncode == 0, result.stderr
    assert "gqa2mla" in result.stdout and "verify" in result.stdout
    sub = _run("gqa2mla", "--help")
    assert sub.exit_code == 0 and "--max-shard-size" in sub.output


# ------------------------------------------------------------------ a bug


def test_a_bug_exits_4_never_a_fails_1_and_writes_nothing(tmp_path, src, monkeypatch):
    """An exception the package did not mean to raise (here: in verification, after the weights
    are written to the temporary sibling) exits 4 with one line naming it and the file that keeps
    its traceback, never 1 (a pipeline would read a FAIL), and no output is put in place."""
    import convert.api

    def broken(*args, **kwargs):
        raise AttributeError("'Qwen2Config' object has no attribute 'head_dim'")

    monkeypatch.setattr(convert.api, "verify", broken)
    out = tmp_path / "out"
    before = _listing(tmp_path)
    result = _run("gqa2mla", src, "-o", out)
    assert result.exit_code == 4, (result.exit_code, result.output)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]  # beside the progress line
    assert line.startswith("error: internal error") and "AttributeError" in line and "head_dim" in line
    saved = Path(line.split("the traceback is in ")[1].split(":")[0])
    try:
        assert "Traceback" in saved.read_text() and "broken" in saved.read_text()
    finally:
        saved.unlink()
    assert _listing(tmp_path) == before
