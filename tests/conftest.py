"""Shared test helpers: tiny transformers models, transformers' own attention as the
reference, and the converted `MLAAttention` on the same inputs.

`fixtures/` (make_tiny.py, realdata.py) is put on sys.path so tests can
`from make_tiny import tiny_hf_model`.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
TESTS = REPO / "tests"
for _path in (FIXTURES, TESTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

TINY_LLAMA = FIXTURES / "tiny-llama"

# Relative Frobenius error allowed for an exact conversion, by dtype (DESIGN §8).
EXACT_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative Frobenius error ||approx - exact|| / ||exact||."""
    approx, exact = approx.detach(), exact.detach()
    return float((approx - exact).norm() / exact.norm())


def hf_model(model_type: str, seed: int = 0, dtype=torch.float32, random_biases: bool = True, **overrides):
    """`tiny_hf_model`, with random (non-zero) attention biases, ready to be a reference.

    transformers initialises biases to zero, which would let a converter that
    drops or misplaces them pass; here every attention bias is random. For
    float64 the reference runs SDPA: transformers' eager attention does its
    softmax in float32 even for float64 inputs, which would cap the reference
    at float32 accuracy.
    """
    from make_tiny import tiny_hf_model

    model = tiny_hf_model(model_type, seed=seed, dtype=dtype, **overrides)
    if random_biases:
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".self_attn." in name and name.endswith(".bias"):
                    param.copy_(0.5 * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(dtype))
    if dtype == torch.float64:
        model.config._attn_implementation = "sdpa"
    return model


def _mask_function(config):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # The same choice the Mistral/Qwen2 model forward makes.
    return create_sliding_window_causal_mask if getattr(config, "sliding_window", None) else create_causal_mask


def hf_inputs(model, batch: int = 2, length: int = 12, seed: int = 0, padding=None):
    """Random hidden states, positions, the model's own rotary embeddings, and its
    causal mask (for the reference module) plus the same mask as an additive float
    4-D tensor (for MLAAttention).

    padding: optional (batch, length) 0/1 attention mask (1 = real token).
    """
    dtype = model.dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, model.config.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    positions = torch.arange(length)[None].expand(batch, -1)
    position_embeddings = model.model.rotary_emb(x, positions)
    make_mask = _mask_function(model.config)
    ref_mask = make_mask(
        config=model.config, inputs_embeds=x, attention_mask=padding, past_key_values=None, position_ids=positions
    )
    eager = copy.copy(model.config)
    eager._attn_implementation = "eager"  # eager masks are additive float (B, 1, L, S)
    mla_mask = make_mask(
        config=eager, inputs_embeds=x, attention_mask=padding, past_key_values=None, position_ids=positions
    )
    assert mla_mask is not None and mla_mask.dtype == dtype and mla_mask.dim() == 4
    return {
        "x": x,
        "positions": positions,
        "position_embeddings": position_embeddings,
        "ref_mask": ref_mask,
        "mla_mask": mla_mask,
    }


@torch.no_grad()
def reference_attention(model, layer: int, inputs: dict) -> torch.Tensor:
    """transformers' own attention module of `layer` on `inputs` (see hf_inputs)."""
    attn = model.model.layers[layer].self_attn
    out = attn(
        inputs["x"],
        position_embeddings=inputs["position_embeddings"],
        attention_mask=inputs["ref_mask"],
        position_ids=inputs["positions"],
    )
    return out[0]



def mla_attention(converted, layer: int, dtype=None, rotary=None):
    """Build `MLAAttention` for `layer` from a converted state dict (with `.config`)."""
    from convert.mla import build_mla_attention, layer_tensors

    mla = converted.config["mla"]
    return build_mla_attention(mla, layer, layer_tensors(converted, mla, layer), rotary=rotary, dtype=dtype)


@torch.no_grad()
def converted_attention(converted, layer: int, inputs: dict, dtype) -> torch.Tensor:
    """The converted layer's output on the same inputs as `reference_attention`."""
    module = mla_attention(converted, layer, dtype)
    out = module(
        inputs["x"],
        position_embeddings=inputs["position_embeddings"],
        attention_mask=inputs["mla_mask"],
        position_ids=inputs["positions"],
    )
    return out[0]


def seed_gqa(D: int, H: int, G: int, d: int, seed: int = 0, dtype=torch.float32, scale: float = 2.0):
    """The seed's MyGQA(D, D, d, d, H, G) with random weights large enough that
    attention is far from uniform (nn.Linear's default init nearly flattens it)."""
    from convert.verify.seed import MyGQA

    module = MyGQA(D, D, d, d, H, G)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (module.W_Q, module.W_K, module.W_V, module.W_O):
            fan_in = lin.weight.shape[1]
            lin.weight.copy_(scale * torch.randn(lin.weight.shape, generator=gen, dtype=torch.float64) / fan_in**0.5)
    return module.to(dtype).eval()


@pytest.fixture
def tiny_llama_dir() -> Path:
    """The shipped fixture checkpoint (read-only: copy it before editing)."""
    assert (TINY_LLAMA / "model.safetensors").is_file(), "run python fixtures/make_tiny.py"
    return TINY_LLAMA
