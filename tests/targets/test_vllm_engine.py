"""The `vllm` target served by the real engine: vLLM's prompt log-probs equal transformers'
DeepseekV3ForCausalLM on the same export within 1e-4 (float32), greedy tokens identical.

Runs only when CONVERT_VLLM_PYTHON is the python of a vLLM venv (scripts/vllm_env.sh
prints it); vLLM lives there, not in the project's environment. ~80 s (engine start).
"""

import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import convert
from convert.targets.vllm import match_vllm_norms

from conftest import REPO

VLLM_PYTHON = os.environ.get("CONVERT_VLLM_PYTHON")
SERVE = REPO / "bench" / "vllm_serve.py"
TOL = 1e-4
PROMPT, NEW = 8, 32

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="CONVERT_VLLM_PYTHON (a vLLM venv's python) not set")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "hidden, n_heads, n_kv_heads, head_dim, rope, healed, family",
    [
        (192, 6, 3, 64, None, False, "llama"),  # SmolLM2's attention shape
        (1024, 16, 8, 128, None, False, "llama"),  # Mistral-7B's: folded frequencies, a compressed latent
        (192, 6, 3, 64, LLAMA3 | {"original_max_position_embeddings": 64, "rope_theta": 10000.0}, False, "llama"),
        (192, 6, 3, 64, None, True, "llama"),  # the export healed through its transformers twin (convert.heal)
        (256, 8, 2, 128, None, False, "qwen2"),  # q/k/v biases carried in the weights (convert.targets.vllm.bias)
        (192, 6, 3, 64, None, False, "llama_bias"),  # Llama's attention_bias: o_proj's too, on the attention outputs
    ],
)
def test_vllm_serves_the_export_as_transformers_computes_it(
    tmp_path, hidden, n_heads, n_kv_heads, head_dim, rope, healed, family
):
    torch.manual_seed(0)
    config_class, model_class = (
        (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_class(
        hidden_size=hidden,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=2,
        vocab_size=256,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        **({"rope_parameters": rope} if rope else {}),
        **({"attention_bias": True} if family == "llama_bias" else {}),
    )
    source = model_class(config).eval()
    with torch.no_grad():  # random biases (transformers starts them at zero)
        for name, param in source.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
    source.save_pretrained(tmp_path / "src")
    calib = torch.randint(0, 256, (1, 128))
    out = tmp_path / "out"
    convert.gqa2mla(tmp_path / "src", out, target="vllm", calib=calib, verify=False, progress=False)
    exported = json.loads((out / "config.json").read_text())["convert_export"]
    if healed:  # trained as transformers runs it: vLLM must serve what was trained
        ids = torch.randint(0, 256, (1, 2048))
        result = convert.heal(out, ids, original=tmp_path / "src", output=tmp_path / "healed", steps=10, lr=1e-2,
                              window=128, check_every=0, progress=False, device="cpu")  # fmt: skip
        assert result.report["after"]["kl_mean"] != result.report["before"]["kl_mean"]  # the weights moved
        out = result.output
    assert exported["latent_compressed"] == (head_dim == 128 and family == "llama")
    assert (exported["attention_biases"] is not None) == (family != "llama")
    if family == "llama_bias":
        assert exported["attention_biases"]["carried"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (60, 33)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"prompts": prompts, "max_model_len": 256, "greedy_new_tokens": NEW}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run(
        [VLLM_PYTHON, str(SERVE), str(out), str(job), str(tmp_path / "res.json")], check=True, env=env, timeout=300
    )
    served = json.loads((tmp_path / "res.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    match_vllm_norms(model)
    for ids, logprobs, greedy in zip(prompts, served["prompt_logprobs"], served["greedy_tokens"]):
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), -1).gather(-1, x[0, 1:, None])[:, 0]
            want = model.generate(x[:, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert float((logp - torch.tensor(logprobs[1:], dtype=torch.float64)).abs().max()) < TOL
        assert want[0, PROMPT:].tolist() == greedy
