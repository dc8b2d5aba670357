"""Each target says what another runtime makes of its output, and the conversion says it aloud:
a `mla` directory is refused by stock transformers without `import convert`; a `vllm` export
opened by stock transformers computes another model (its latent norm's eps), which the conversion's
notes state, while `convert.targets.load_output` gives the model vLLM serves."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import convert
from convert.targets import TARGETS, load_output, target

from conftest import REPO, TINY_LLAMA


def _tiny_llama(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
        vocab_size=128, intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_every_target_says_what_other_runtimes_make_of_it():
    for name in TARGETS:
        assert len(target(name).FOREIGN) > 40, name


def test_a_vllm_export_in_stock_transformers_is_another_model_and_the_conversion_says_so(tmp_path):
    src = _tiny_llama(tmp_path)  # one key/value head of dim 64: the exact vllm case
    result = convert.gqa2mla(src, tmp_path / "vllm", target="vllm", verify=False, progress=False)
    assert any("stock transformers" in note and "match_vllm_norms" in note for note in result.notes)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    original = _logits(AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    as_vllm = _logits(load_output(tmp_path / "vllm", "cpu", torch.float32).eval(), ids)
    stock = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "vllm").eval(), ids)
    assert float((as_vllm - original).norm() / original.norm()) < 1e-5  # what vLLM computes: the original
    assert float((stock - original).norm() / original.norm()) > 1e-2  # what the note warns about


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
