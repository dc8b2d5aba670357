"""Absorbed compression with nearly static RoPE frequencies cached as NoPE dims (`--nope-angle`):
which frequencies, the [rotary pairs | NoPE] latent (exact at full rank, rotating like the keys
with the static frequencies held still), the budget split, and the checkpoint it writes."""

import math

import pytest
import torch

import convert
from convert.compress import static_frequencies
from convert.linalg import rope_factor
from convert.linalg.weighted import decoupled_rope_factor, decoupled_spectrum, static_split
from convert.plan import plan_for_config
from convert.rope.rotation import apply_rope, latent_cos_sin

from conftest import hf_model

SMOLLM2_LIKE = {  # SmolLM2-135M's attention: θ = 1e5, d = 64, 8,192 positions
    "model_type": "llama",
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "vocab_size": 32,
    "rope_theta": 1e5,
    "max_position_embeddings": 8192,
}


def _spec(config):
    return plan_for_config(config).spec  # the exact plan's spec: the geometry, no weights


def test_static_frequencies_turn_less_than_the_angle_over_the_span():
    spec = _spec(SMOLLM2_LIKE)
    static = static_frequencies(spec, SMOLLM2_LIKE, 0.75)
    assert static == tuple(range(24, 32))  # θ_24 = 1e5^-0.75 = 1.78e-4: 0.73 rad over 4,096 tokens
    for j in range(32):
        turn = 1e5 ** (-2 * j / 64) * 4096
        assert (j in static) == (turn < 0.75)
    assert static_frequencies(spec, SMOLLM2_LIKE, 0.0) == ()
    short = SMOLLM2_LIKE | {"max_position_embeddings": 1024}  # a shorter span: more frequencies are static
    assert len(static_frequencies(spec, short, 0.75)) > len(static)


def _keys(n_kv_heads=2, head_dim=8, hidden=24, seed=0):
    return torch.randn(
        n_kv_heads * head_dim, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def test_full_rank_is_exact_and_keeps_static_rows_out_of_the_pairs():
    w, static = _keys(), (2, 3)
    factor = decoupled_rope_factor(w, 2, 16, static)
    assert factor.rank == 16 and torch.allclose(factor.up @ factor.down, w, atol=1e-12)
    assert set(factor.freq_index.tolist()) == {0, 1}  # only rotary frequencies get pairs
    assert 2 * len(factor.freq_index) == 2 * 2 * 2  # 2 rotary freqs × 2 heads, one pair each


def test_latent_rope_rotates_the_rotary_keys_and_leaves_the_static_ones():
    """R_m (up c) = up (R̃_m c) with the static frequencies' angle set to zero."""
    w, static, d = _keys(), (3,), 8
    factor = decoupled_rope_factor(w, 2, 16, static)
    y = torch.randn(5, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inv = torch.tensor([1.0, 0.3, 0.1, 0.0], dtype=torch.float64)  # the static frequency held still
    angles = torch.arange(5, dtype=torch.float64)[:, None] * inv  # (L, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (L, d)
    keys = (y @ w.T).view(5, 2, d)  # (L, G, d)
    want = apply_rope(keys, cos[:, None], sin[:, None]).reshape(5, -1)
    c = y @ factor.down.T  # (L, r)
    l_cos, l_sin = latent_cos_sin(cos, sin, factor.freq_index)
    got = apply_rope(c, l_cos, l_sin) @ factor.up.T
    assert torch.allclose(got, want, atol=1e-12)


def test_the_budget_goes_where_the_error_is():
    """Static rows with no energy take no dims; rotary rows with none, none either."""
    w, static = _keys(), (2, 3)
    rot_rows, st_rows, _ = static_split(2, 8, static)
    quiet_static = w.clone()
    quiet_static[st_rows] = 0
    factor = decoupled_rope_factor(quiet_static, 2, 6, static)
    assert len(factor.freq_index) == 3  # 6 dims = 3 rotary pairs
    quiet_rotary = w.clone()
    quiet_rotary[rot_rows] = 0
    factor = decoupled_rope_factor(quiet_rotary, 2, 5, static)
    assert len(factor.freq_index) == 0 and torch.count_nonzero(factor.down.norm(dim=1)) == 5
    spectrum = decoupled_spectrum(w, 2, static)
    assert len(spectrum) == 16 and torch.all(spectrum[:-1] >= spectrum[1:])


def test_without_static_frequencies_it_is_the_per_frequency_factor():
    w = _keys()
    plain, decoupled = rope_factor(w, 2, 8), decoupled_rope_factor(w, 2, 8, ())
    assert torch.allclose(plain.up @ plain.down, decoupled.up @ decoupled.down, atol=1e-10)


def test_compressed_absorbed_checkpoint_with_static_frequencies_loads(tmp_path):
    model = hf_model("llama")  # 256 positions, θ = 1e4, d = 16: frequencies 5-7 turn < 2 rad
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    result = convert.gqa2mla(
        tmp_path / "src", tmp_path / "mla", rank=15, method="svd", nope_angle=2.0, verify=False, progress=False
    )
    comp = result.config["mla"]["compression"]
    assert comp["static_freqs"] and comp["nope_angle"] == 2.0
    loaded = convert.load_mla_model(tmp_path / "mla")
    attn = loaded.model.layers[0].self_attn
    assert attn.rank_k == 15 and 2 * len(attn.key_freq_index) <= 15
    assert not set(attn.key_freq_index) & set(comp["static_freqs"])
    inv = model.model.rotary_emb.inv_freq
    assert comp["static_freqs"] == [5, 6, 7] and all(float(inv[j]) * 256 < 2.0 for j in comp["static_freqs"])
    with torch.no_grad():
        assert math.isfinite(float(loaded(torch.tensor([[1, 2, 3]])).logits.sum()))


def test_nope_angle_zero_keeps_every_frequency_rotary():
    model = hf_model("llama")
    with pytest.raises(convert.ConvertError, match="odd"):
        convert.to_mla(model, rank=15, method="svd", nope_angle=0)
    with pytest.raises(convert.ConvertError, match="nope_angle"):
        convert.to_mla(model, rank=16, method="svd", nope_angle=-1)


def test_hermitian_pair_weights_are_the_rotation_averaged_fisher_form():
    """e_jᴴ H_j e_j = the mean over RoPE angles of [a; b]ᵀ F_j [a; b], cross-head terms included."""
    from convert.linalg.weighted import hermitian_pair_weights

    g, d = 3, 8
    gen = torch.Generator().manual_seed(4)
    root = torch.randn(g * d, g * d, generator=gen, dtype=torch.float64)
    fisher = root @ root.T  # (G·d, G·d) positive definite, cross-head and cross-dim terms
    weights = hermitian_pair_weights(fisher, g)  # (d/2, G, G) = H_j^{1/2}
    e = torch.randn(g, d, generator=gen, dtype=torch.float64)  # a key error (G, d)
    angles = torch.linspace(0, 2 * math.pi, 65, dtype=torch.float64)[:-1]
    for j in range(d // 2):
        pair = e[:, [j, j + d // 2]]  # (G, 2): a, b
        rows = [h * d + j for h in range(g)] + [h * d + j + d // 2 for h in range(g)]
        f_j = fisher[rows][:, rows]
        turned = [
            torch.cat([pair[:, 0] * c - pair[:, 1] * s, pair[:, 0] * s + pair[:, 1] * c])
            for c, s in zip(angles.cos(), angles.sin())
        ]
        averaged = torch.stack([v @ f_j @ v for v in turned]).mean()
        z = torch.complex(pair[:, 0], pair[:, 1])  # (G,)
        hz = weights[j] @ z
        assert torch.allclose((hz.conj() @ hz).real, averaged, rtol=1e-10)
