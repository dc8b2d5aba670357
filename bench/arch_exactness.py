"""Exactness per architecture: converted vs transformers' own model, logits relative error.

For each family (tiny random models from transformers' own config classes, random attention
biases and, for the q/k-norm families (Qwen3, OLMo 2, Gemma 3), random q/k norm weights), layout and dtype: the relative Frobenius
error of the converted model's logits (`convert.to_mla`) against the original's, on 2×64
random tokens, and whether 24 greedy tokens are identical.

    python bench/arch_exactness.py        # ~1 min; writes bench/results/arch_exactness/arch_exactness.json
"""

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "fixtures"))

import _common  # noqa: E402

import convert  # noqa: E402

from conftest import hf_model  # noqa: E402

FAMILIES = {
    "llama": {"attention_bias": True},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"attention_bias": True},
    "olmo2": {"attention_bias": True},
    "gemma2": {},  # eager reference: transformers soft-caps only there (float32 softmax)
    "gemma3_text": {},  # q/k norms scale by (1 + weight): random offsets below
    "phi3": {},  # fused qkv_proj, partial RoPE (12 of 16 dims)
    "mixtral": {},
}


def build(family: str, dtype: torch.dtype):
    model = hf_model(family, dtype=dtype, **FAMILIES[family])
    if family == "gemma2":
        model.config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                offset = 0 if family == "gemma3_text" else 1  # Gemma stores the weight's offset from one
                param.copy_(
                    (offset + 0.5 * torch.randn(param.shape, generator=generator, dtype=torch.float64)).to(dtype)
                )
    return model


def measure(family: str, layout: str, dtype: torch.dtype) -> dict:
    model = build(family, dtype)
    converted = convert.to_mla(model, layout=layout)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(ids).logits.double(), converted(ids).logits.double()
    greedy = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    same = torch.equal(model.generate(ids[:1, :8], **greedy), converted.generate(ids[:1, :8], **greedy))
    return {
        "family": family,
        "layout": layout,
        "dtype": str(dtype).removeprefix("torch."),
        "logits_rel_error": float((got - ref).norm() / ref.norm()),
        "greedy_identical": same,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=_common.result_file("arch_exactness"))
    args = parser.parse_args(argv)
    rows = [
        measure(family, layout, dtype)
        for family in FAMILIES
        for layout in ("absorbed", "factored")
        for dtype in (torch.float32, torch.float64)
    ]
    result = _common.header("arch_exactness", "cpu", {"quiet": None}) | {"rows": rows}
    _common.write_json(args.out, result)
    print(
        _common.table(
            ["family", "layout", "dtype", "logits rel. error", "greedy identical"],
            [[r["family"], r["layout"], r["dtype"], r["logits_rel_error"], r["greedy_identical"]] for r in rows],
        )
    )


if __name__ == "__main__":
    main()
