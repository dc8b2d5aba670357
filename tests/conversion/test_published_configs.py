"""Configs as published, not as our fixtures write them: a tiny checkpoint of every family whose
config.json has the keys its published config has and lacks (`fixtures/published.py`), in its
published dtype, through every target and layout. No traceback anywhere: an exact conversion
PASSes, a lossy one runs to its verdict, and what a target cannot express is refused in one line
(exit 2) with nothing written. A crash would exit 4, never 1."""

import os

import pytest
from click.testing import CliRunner
from published import PUBLISHED, write_published

from convert.cli import main

#: calibration and judging text for the tiny models (their vocabulary is 128 tokens: any bytes do)
_TEXT = " ".join(f"{w} {i % 97}" for i, w in enumerate(("the of and to a in is it that was " * 300).split()))
_LOSSY = ("--max-ppl-ratio", "100", "--tokens", "128", "--calib-tokens", "1024", "--fisher-tokens", "512")
_LOSSY += ("--refine-steps", "3")

#: name -> the CLI's arguments; True where every family must convert and PASS
COMBOS = {
    "mla-absorbed": ((), True),
    "mla-factored": (("--layout", "factored"), True),
    "mla-factored-kv50": (("--layout", "factored", "--kv-cache-ratio", "0.5", *_LOSSY), False),
    "mla-absorbed-kv50": (("--layout", "absorbed", "--kv-cache-ratio", "0.5", *_LOSSY), False),
    "transformers": (("--target", "transformers"), False),
    "vllm": (("--target", "vllm", *_LOSSY[:-2]), False),
}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    (root / "calib.txt").write_text(_TEXT)
    (root / "text.txt").write_text(_TEXT[::-1])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("family", PUBLISHED)
def test_published_config_converts_or_is_refused_in_one_line(published, family, combo):
    src = published / family
    if not src.exists():
        write_published(family, src)
    args, must_pass = COMBOS[combo]
    if "--max-ppl-ratio" in args:
        args = (*args, "--calib", published / "calib.txt", "--text", published / "text.txt")
    out = published / f"{family}-{combo}"
    before = set(os.listdir(published))
    result = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(out), *map(str, args)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code in ((0,) if must_pass else (0, 2)), (result.exit_code, errors)
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert (out / "verification.json").is_file()
    else:
        assert len(errors) == 1, result.stderr
        assert set(os.listdir(published)) == before  # nothing written


def test_every_published_config_lacks_what_its_family_lacks():
    """The fixture keeps the published files' gaps: Qwen2.5, Mistral v0.3, Mixtral, OLMo 2, Phi-3
    and SmolLM2 have no head_dim; Gemma 2/3 no tie_word_embeddings (transformers ties them)."""
    no_head_dim = {n for n, c in PUBLISHED.items() if "head_dim" not in c}
    assert no_head_dim == {"smollm2", "mistral", "mixtral", "qwen2.5", "olmo2", "phi3"}
    assert {n for n, c in PUBLISHED.items() if "tie_word_embeddings" not in c} == {"gemma2", "gemma3"}
    nemo = PUBLISHED["mistral-nemo"]
    assert nemo["head_dim"] * nemo["num_attention_heads"] != nemo["hidden_size"]
