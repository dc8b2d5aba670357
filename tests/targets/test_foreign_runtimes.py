"""Each target says what another runtime makes of its output, and the conversion says it aloud:
a `mla` directory is refused by stock transformers without `import convert`; a `vllm` export
opened by stock transformers computes, to the bit, what vLLM does (a latent bias only transformers
reads stands in for the latent norm's eps it hard-codes), as `convert.targets.load_output` does."""

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_llama
from transformers import AutoModelForCausalLM

import convert
from convert.targets import TARGETS, load_output, target

from conftest import REPO, TINY_LLAMA


def _tiny_llama(tmp_path):
    tiny_llama(1).save_pretrained(tmp_path / "src")  # one key/value head of dim 64: exact for every target
    return tmp_path / "src"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_every_target_says_what_other_runtimes_make_of_it():
    for name in TARGETS:
        assert len(target(name).FOREIGN) > 40, name


@pytest.mark.parametrize("name", ["transformers", "vllm"])
def test_an_exports_notes_are_short_say_what_to_do_and_say_it_once(name, tmp_path):
    """The summary's notes: each one line a reader takes in at once, each with the thing to do, and
    no warning twice (the report keeps the whole account)."""
    result = convert.gqa2mla(_tiny_llama(tmp_path), tmp_path / name, target=name, verify=False, progress=False)
    assert result.notes and all(len(note) <= 240 for note in result.notes), result.notes
    text = " ".join(result.notes)
    assert text.count("vLLM") <= 2 if name == "transformers" else "computes the model vLLM serves" in text
    assert ("--target vllm" in text) if name == "transformers" else ("convert heal" in text)
    assert len(set(result.notes)) == len(result.notes)


def _as_vllm_computes(model):
    """transformers' DeepseekV3 as vLLM runs a checkpoint (vllm/model_executor/models/deepseek_v2.py):
    kv_a_proj_with_mqa and o_proj built with bias=False, their checkpoint biases skipped, and the
    latent norm `RMSNorm(kv_lora_rank, eps=config.rms_norm_eps)`."""
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.kv_a_proj_with_mqa.bias = attention.o_proj.bias = None
        attention.kv_a_layernorm.variance_epsilon = model.config.rms_norm_eps
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vllm_export_in_stock_transformers_computes_what_vllm_does(tmp_path, dtype):
    """Stock transformers hard-codes the latent norm's eps (1e-6) where vLLM reads rms_norm_eps (2^40):
    the export's latent bias, which vLLM skips, makes up the difference, to the bit (eager)."""
    src = _tiny_llama(tmp_path)  # one key/value head of dim 64: the exact vllm case
    out = tmp_path / "vllm"
    result = convert.gqa2mla(src, out, target="vllm", verify=False, progress=False, dtype=str(dtype)[6:])
    assert any("stock transformers" in note and "computes the model vLLM serves" in note for note in result.notes)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    original = _logits(load(src), ids).float()
    stock = _logits(load(out), ids)
    vllm = _logits(_as_vllm_computes(load(out)), ids)
    assert torch.equal(stock, vllm)
    assert torch.equal(_logits(load_output(out, "cpu", dtype), ids), vllm)  # convert's own loader too
    assert float((vllm.float() - original).norm() / original.norm()) < (1e-5 if dtype == torch.float32 else 3e-2)


def test_a_vllm_export_without_the_latent_bias_is_still_loaded_as_vllm_serves_it(tmp_path):
    """An export written before the latent bias (attention_bias false, no biases): stock transformers
    computes another model, `load_output` (`match_vllm_norms`) the one vLLM serves."""
    from safetensors.torch import load_file, save_file

    src = _tiny_llama(tmp_path)
    out = tmp_path / "vllm"
    convert.gqa2mla(src, out, target="vllm", verify=False, progress=False)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"attention_bias": False}))
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v for k, v in tensors.items() if not k.endswith(".bias")}, file, metadata={"format": "pt"})
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    original = _logits(AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    as_vllm = _logits(load_output(out, "cpu", torch.float32).eval(), ids)
    stock = _logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids)
    assert float((as_vllm - original).norm() / original.norm()) < 1e-5
    assert float((stock - original).norm() / original.norm()) > 1e-2


def test_healing_a_vllm_export_leaves_what_vllm_skips(tmp_path):
    from convert.healing import trainable_parameters

    src = _tiny_llama(tmp_path)
    convert.gqa2mla(src, tmp_path / "vllm", target="vllm", verify=False, progress=False)
    names = trainable_parameters(load_output(tmp_path / "vllm", "cpu", torch.float32))
    assert names and not any(name.endswith(".bias") for name in names)


def test_a_native_directory_is_refused_by_stock_transformers(tmp_path):
    out = tmp_path / "mla"
    convert.gqa2mla(TINY_LLAMA, out, verify=False, progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "convert_mla"
    code = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode != 0 and "convert_mla" in done.stderr


def test_the_options_offer_exactly_the_tables_targets():
    from convert.options import TARGETS as CHOICES

    assert tuple(TARGETS) == CHOICES
