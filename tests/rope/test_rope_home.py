"""RoPE has one home (`convert.rope`): what a config says of it, its frequencies, the rotation. The
other modules call it; this checks that they do not grow their own copies, and that the home computes
what transformers computes. (Checking config.json's RoPE fields for type errors is the validator's,
`convert.arch.validate`, with every other field's check.)"""

import ast
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from convert.rope.config import parameter_sets, rope_type
from convert.rope.frequencies import fold, inv_freq, transformers_inv_freq
from convert.rope.rotation import apply_rope, complex_pairs, rotate_half_pairs

PACKAGE = Path(__file__).resolve().parents[2] / "convert"
HOME = PACKAGE / "rope"
#: RoPE's math and its reading from a config: defined in `convert.rope` and nowhere else.
RESIDENT = {
    "rope_type", "parameter_sets", "inv_freq", "transformers_inv_freq", "longrope_inv_freq", "longrope_factors",
    "llama3_factors", "fold", "apply_rope", "latent_cos_sin", "rotate_half_pairs", "complex_pairs", "rotation_blocks",
    "rotate_half", "rope_inv_freq",
}  # fmt: skip


def _outside_home():
    for path in sorted(PACKAGE.rglob("*.py")):
        if HOME not in path.parents:
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def test_rope_math_is_defined_only_in_its_home():
    strays = [
        f"{path.relative_to(PACKAGE.parent)}: {node.name}"
        for path, tree in _outside_home()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in RESIDENT
    ]
    assert not strays, f"RoPE math outside convert/rope: {strays}"


def test_only_the_home_calls_transformers_rope_init():
    callers = [
        str(path.relative_to(PACKAGE.parent))
        for path, tree in _outside_home()
        if any(isinstance(n, ast.Name) and n.id == "ROPE_INIT_FUNCTIONS" for n in ast.walk(tree))
    ]
    assert not callers, f"transformers' RoPE init called outside convert/rope/frequencies.py: {callers}"


def test_rope_type_reads_either_field_and_either_key():
    assert rope_type({"hidden_size": 1536, "num_attention_heads": 12}) == "default"
    assert rope_type({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}) == "llama3"
    assert rope_type({"rope_scaling": {"type": "linear", "factor": 2.0}}) == "linear"  # the older key
    assert rope_type({"rope_parameters": {"rope_theta": 1e6}}) == "default"


def test_parameter_sets_name_each_layer_types_own():
    nested = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    assert parameter_sets(nested) == [
        ("rope_parameters.full_attention", {"rope_theta": 1e6}),
        ("rope_parameters.sliding_attention", {"rope_theta": 1e4}),
        ("rope_scaling", {}),
    ]
    assert parameter_sets({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})[1] == (
        "rope_scaling",
        {"rope_type": "linear", "factor": 2.0},
    )


def test_frequencies_are_transformers_own():
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    )
    want = LlamaRotaryEmbedding(config).inv_freq  # float32
    got = transformers_inv_freq(config, 64)
    assert got.dtype == torch.float64 and torch.equal(got, inv_freq(5e5, 64))
    assert torch.allclose(got.float(), want, rtol=2e-7, atol=0)
    scaled = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    )
    assert torch.allclose(transformers_inv_freq(scaled, 64), inv_freq(1e4, 64) / 4, rtol=1e-6)
    assert fold(128, 64) == 2 and fold(64, 64) == 1 and fold(256, 256) == 1


def test_rotation_is_transformers_rotate_half():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 64), torch.randn(2, 2, 7, 64)
    angles = torch.arange(7.0)[:, None] * inv_freq(1e4, 64).float()  # (L, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None], torch.cat([angles.sin()] * 2, -1)[None]  # (1, L, d)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    # the same products and sum, rounded once more or less (a fused multiply-add): within an ulp or two
    assert torch.allclose(apply_rope(q, cos[:, None], sin[:, None]), want_q, rtol=0, atol=1e-6)
    assert torch.allclose(apply_rope(k, cos[:, None], sin[:, None]), want_k, rtol=0, atol=1e-6)
    # the first 32 dims rotate, the others pass (partial RoPE)
    part = apply_rope(q, cos[:, None, :, :16].repeat(1, 1, 1, 2), sin[:, None, :, :16].repeat(1, 1, 1, 2))
    assert torch.equal(part[..., 32:], q[..., 32:]) and not torch.equal(part[..., :32], q[..., :32])


def test_complex_pairs_turn_as_the_keys_do():
    """Key pair j read as a complex number multiplies by e^{iθ_j·m} when RoPE turns the key by position m."""
    torch.manual_seed(1)
    n_kv_heads, head_dim, hidden = 2, 16, 8
    weight = torch.randn(n_kv_heads * head_dim, hidden, dtype=torch.float64)
    x = torch.randn(hidden, dtype=torch.float64)
    theta = inv_freq(1e4, head_dim) * 5  # position 5
    cos, sin = torch.cat([theta.cos()] * 2), torch.cat([theta.sin()] * 2)
    keys = (weight @ x).reshape(n_kv_heads, head_dim)  # (G, d)
    turned = apply_rope(keys, cos, sin)  # (G, d)
    pairs = complex_pairs(weight, n_kv_heads) @ x.to(torch.complex128)  # (d/2, G)
    want = pairs * torch.polar(torch.ones_like(theta), theta)[:, None]
    first, second = rotate_half_pairs(head_dim)
    assert torch.allclose(torch.complex(turned[:, first], turned[:, second]).T, want, atol=1e-12)
