"""The Python API refuses misuse as the command line does: a `ConvertError` (exit 2 there) whose one
line names the parameter in Python's words (`kv_cache_ratio=`, `output`), where the command line
names its flags (`--kv-cache-ratio`, `-o`); a misspelled keyword or flag names only what it is a
likely typo of; help(convert) starts with the package's API."""

import pydoc

import pytest
import torch
import transformers
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.errors import UnknownOption
from convert.options import python_terms, suggest

from conftest import TINY_LLAMA


@pytest.fixture(scope="module")
def tiny_model():
    return transformers.AutoModelForCausalLM.from_pretrained(TINY_LLAMA)


@pytest.mark.parametrize(
    "call, typo, likely",
    [
        (lambda **kw: convert.gqa2mla(TINY_LLAMA, "never-written", **kw), "layuot", "layout"),
        (lambda **kw: convert.gqa2mla(TINY_LLAMA, "never-written", **kw), "kv", "kv_cache_ratio"),
        (lambda **kw: convert.heal("never-written", "text.txt", **kw), "stesp", "steps"),
        (lambda **kw: convert.convert_state_dict({}, None, **kw), "rnak", "rank"),
    ],
    ids=["gqa2mla layout", "gqa2mla prefix", "heal", "convert_state_dict"],
)
def test_a_misspelled_keyword_is_a_convert_error_naming_the_likely_one(call, typo, likely, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownOption) as refused:
        call(**{typo: 1})
    assert isinstance(refused.value, convert.ConvertError) and isinstance(refused.value, TypeError)
    assert str(refused.value) == f"unknown option {typo}=1; did you mean {likely}?"
    assert not any(tmp_path.iterdir())


def test_suggestions_name_only_likely_names():
    known = ["layout", "latent", "kv_cache_ratio", "rank", "tokens", "calib_tokens", "steps", "text"]
    assert suggest("layuot", known) == ["layout"]
    assert suggest("kv", known) == ["kv_cache_ratio"]
    assert suggest("tokns", known) == ["tokens"]
    assert suggest("zzzz", known) == []


@pytest.mark.parametrize(
    "flag, likely",
    [("--layuot", "--layout"), ("--kv", "--kv-cache-ratio"), ("--tokns", "--tokens"), ("--zzzz", None)],
)
def test_a_misspelled_flag_names_only_the_likely_one(flag, likely):
    result = CliRunner().invoke(main, ["gqa2mla", str(TINY_LLAMA), flag, "1"])
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    if likely is None:
        assert "Did you mean" not in last and "--help" in last, last
    else:
        assert last.endswith(f"Did you mean {likely}?"), last


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m, tmp: convert.gqa2mla(123), "src=123: expected a path"),
        (lambda m, tmp: convert.gqa2mla(TINY_LLAMA, tmp / "o", tokens="100"), "tokens='100': expected an int, got str"),
        (lambda m, tmp: convert.gqa2mla(TINY_LLAMA, tmp / "o", force=1), "force=1: expected True or False"),
        (lambda m, tmp: convert.to_mla(None), "model=None: expected a transformers causal LM"),
        (lambda m, tmp: convert.to_mla(torch.nn.Linear(2, 2)), "expected a transformers causal LM"),
        (lambda m, tmp: convert.to_mla(m, kv_cache_ratio="half"), "kv_cache_ratio='half': expected a number"),
        (lambda m, tmp: convert.to_mla(m, kv_cache_ratio=0.5, calib=[1, 2]), "calib=[1, 2]: expected a path"),
        (lambda m, tmp: convert.heal(None, "t.txt"), "model_or_path=None: expected a converted model"),
        (lambda m, tmp: convert.heal(tmp, "t.txt", steps="3"), "steps='3': expected an int or None"),
        (lambda m, tmp: convert.load_mla_model(None), "path=None: expected a path"),
        (lambda m, tmp: convert.convert_state_dict(None, None), "state_dict: expected a dict of tensors"),
    ],
    ids=[
        "src",
        "tokens",
        "force",
        "to_mla None",
        "to_mla module",
        "ratio",
        "calib",
        "heal model",
        "heal steps",
        "load path",
        "state dict",
    ],
)
def test_a_wrong_argument_is_a_convert_error_naming_it(call, words, tiny_model, tmp_path):
    with pytest.raises(convert.ConvertError) as refused:
        call(tiny_model, tmp_path)
    assert words in str(refused.value)
    assert "--" not in str(refused.value)


def test_the_api_names_keywords_where_the_cli_names_flags(tmp_path):
    """The same refusal in each one's words: the API's has no flag left in it."""
    with pytest.raises(convert.ConvertError) as api:
        convert.gqa2mla(TINY_LLAMA, tmp_path / "o", kv_cache_ratio=0.5)
    cli = CliRunner().invoke(main, ["gqa2mla", str(TINY_LLAMA), "-o", str(tmp_path / "o"), "--kv-cache-ratio", "0.5"])
    assert cli.exit_code == 2
    assert "--max-ppl-ratio R" in cli.stderr and "--no-verify" in cli.stderr
    assert "max_ppl_ratio=R" in str(api.value) and "verify=False" in str(api.value) and "--" not in str(api.value)
    with pytest.raises(convert.ConvertError, match="choose another output$"):
        convert.gqa2mla(TINY_LLAMA, TINY_LLAMA)


@pytest.mark.parametrize(
    "cli, python",
    [
        ("--layout 'nope' is not one of absorbed, factored", "layout='nope' is not one of absorbed, factored"),
        ("pass --force, or choose another -o", "pass force=True, or choose another output"),
        ("with --no-verify and -q", "with verify=False and progress=False"),
        ("--tokens 1 must be at least 2", "tokens=1 must be at least 2"),
        ("or --method svd", "or method='svd'"),
        ("--text JSONL files and the --text-field", "text=JSONL files and the text_field"),
        ("see convert gqa2mla --help; a-b --bogus", "see convert gqa2mla --help; a-b --bogus"),
    ],
)
def test_python_terms(cli, python):
    assert python_terms(cli) == python


def test_help_of_the_package_starts_with_its_api():
    text = pydoc.render_doc(convert, renderer=pydoc.plaintext)
    lines = text.splitlines()
    first = "\n".join(lines[:25])
    for name in ("gqa2mla(", "to_mla(", "convert_state_dict(", "heal(", "load_mla_model(", "ConvertError"):
        assert name in first, name
    assert len(lines) < 1000, len(lines)  # transformers' inherited pages are not in it
    assert "PreTrainedModel" not in text
    assert convert.MLAForCausalLM.__module__ == "convert.mla.causal_lm"  # still the package's, by name
