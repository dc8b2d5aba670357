"""The native output format can't be mistaken for the original: its own model type
(`convert_mla`), loadable with transformers' Auto classes once `convert` is imported,
refused by transformers without it, and usable in a training loop."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import convert
from convert.mla.format import MLA_MODEL_TYPE

from conftest import TINY_LLAMA


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "tiny-mla"
    convert.gqa2mla(TINY_LLAMA, out, verify=False, progress=False)
    return out


def _ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))


def test_config_has_its_own_model_type(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == MLA_MODEL_TYPE and config["architectures"] == ["MLAForCausalLM"]
    assert config["mla"]["source_model_type"] == "llama" and config["mla"]["format_version"] == 2


def test_auto_classes_load_the_mla_model(converted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted)
    assert isinstance(model, convert.MLAForCausalLM)
    reference = convert.load_mla_model(converted)
    original = AutoModelForCausalLM.from_pretrained(TINY_LLAMA)
    ids = _ids()
    with torch.no_grad():
        got, ref, orig = model(ids).logits, reference(ids).logits, original(ids).logits
    assert torch.equal(got, ref)
    assert float((got - orig).norm() / orig.norm()) < 1e-5  # the conversion is exact
    prompt = ids[:, :6]
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **greedy), original.generate(prompt, **greedy))


def test_save_pretrained_round_trips(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == MLA_MODEL_TYPE
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, model(_ids()).logits)


@pytest.mark.slow
def test_transformers_alone_refuses_it(converted):
    code = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(converted)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert MLA_MODEL_TYPE in run.stderr  # "unrecognized model type convert_mla", not a silent Llama


def test_trains_like_any_causal_lm(converted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted)
    ids = _ids(32)
    out = model(ids, labels=ids)
    out.loss.backward()
    grad = model.model.layers[0].self_attn.k_down.weight.grad
    assert out.loss.isfinite() and grad is not None and grad.abs().sum() > 0


def test_format_1_directories_still_load(converted, tmp_path):
    old = tmp_path / "format1"
    shutil.copytree(converted, old)
    config = json.loads((old / "config.json").read_text())
    config["model_type"] = config["mla"].pop("source_model_type")
    config["mla"]["format_version"] = 1
    config.pop("architectures")
    (old / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert torch.equal(convert.load_mla_model(old)(_ids()).logits, convert.load_mla_model(converted)(_ids()).logits)
