"""convert.linalg: factorizations, the RoPE latent, head maps and absorption.

Every identity is checked against an independent construction (explicit loops,
transformers' repeat_kv, the seed's copy-concatenation), in float64.
"""

import dataclasses

import numpy as np
import pytest
import torch

from convert.linalg import (
    absorb_output,
    absorb_query,
    expand_groups,
    group_of_head,
    joint_factor,
    numerical_rank,
    real_factor,
    rope_factor,
    tile_rows,
    work_dtype,
)

F64_TOL = 1e-12


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------ real_factor


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (12, 12), (1, 5)])
def test_real_factor_exact(shape):
    w = _randn(*shape)
    f = real_factor(w)
    r = min(shape)
    assert f.up.shape == (shape[0], r) and f.down.shape == (r, shape[1]) and f.rank == r
    assert _rel(f.up @ f.down, w) < F64_TOL
    # the seed's Part 9 convention: up = U (orthonormal columns), down = diag(σ) Vᵀ
    assert torch.allclose(f.up.T @ f.up, torch.eye(r, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(f.down.norm(dim=1), torch.linalg.svdvals(w), rtol=1e-12)
    assert f.retained_energy() == pytest.approx(1.0, abs=1e-12)


def test_real_factor_exact_on_rank_deficient_input():
    w = _randn(10, 3, seed=1) @ _randn(3, 20, seed=2)  # rank 3, 10 × 20
    assert numerical_rank(w) == 3
    f = real_factor(w)
    assert _rel(f.up @ f.down, w) < F64_TOL
    f3 = real_factor(w, rank=3)  # the numerical rank is already exact
    assert f3.rank == 3 and _rel(f3.up @ f3.down, w) < 1e-12


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_real_factor_truncation_keeps_top_singular_values(rank):
    w = _randn(8, 16, seed=3)
    s = torch.linalg.svdvals(w)
    f = real_factor(w, rank=rank)
    assert f.rank == rank and f.up.shape == (8, rank) and f.down.shape == (rank, 16)
    assert torch.allclose(f.kept, s[:rank], rtol=1e-12)
    assert torch.allclose(f.singular_values, s, rtol=1e-12)
    energy = float((s[:rank] ** 2).sum() / (s**2).sum())
    assert f.retained_energy() == pytest.approx(energy, rel=1e-12)
    assert f.retained_energy() < 1.0
    # Eckart–Young: the truncation error is exactly the dropped singular values
    err2 = float(((w - f.up @ f.down) ** 2).sum())
    assert err2 == pytest.approx(float((s[rank:] ** 2).sum()), rel=1e-10)


def test_joint_factor_shares_down_and_is_exact():
    k, v = _randn(8, 32, seed=4), _randn(8, 32, seed=5)
    kf, vf = joint_factor(k, v)
    assert kf.down is vf.down or torch.equal(kf.down, vf.down)
    assert kf.rank == numerical_rank(torch.cat([k, v])) == 16
    assert _rel(kf.up @ kf.down, k) < F64_TOL
    assert _rel(vf.up @ vf.down, v) < F64_TOL
    # a shared low-rank structure is found exactly at the smaller rank
    base = _randn(5, 32, seed=6)
    k2, v2 = _randn(8, 5, seed=7) @ base, _randn(8, 5, seed=8) @ base
    kf2, vf2 = joint_factor(k2, v2)
    assert kf2.rank == 5
    assert _rel(kf2.up @ kf2.down, k2) < 1e-10 and _rel(vf2.up @ vf2.down, v2) < 1e-10


# ------------------------------------------------------------------ rope_factor


def _hf_cos_sin(positions, head_dim, theta=10000.0):
    """cos/sin as HF's default rotary embedding builds them: (L, d), frequencies repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    freqs = positions.double()[:, None] * inv_freq[None]  # (L, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x, cos, sin):
    """rotate_half RoPE, written out independently of convert.mla."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("G,d,X", [(2, 8, 24), (1, 16, 20), (4, 4, 6), (3, 8, 2)])
def test_rope_factor_exact(G, d, X):
    w = _randn(G * d, X, seed=G + d)
    f = rope_factor(w, G)
    assert _rel(f.up @ f.down, w) < F64_TOL
    assert f.rank == d * min(G, X)
    assert f.freq_index.shape == (f.rank // 2,)
    # every frequency appears min(G, X) times
    counts = torch.bincount(f.freq_index, minlength=d // 2)
    assert counts.tolist() == [min(G, X)] * (d // 2)


@pytest.mark.parametrize("rank", [None, 6, 2])
@pytest.mark.parametrize("G,d,X", [(2, 8, 24), (3, 16, 40)])
def test_rope_commutes_with_latent(G, d, X, rank):
    """Rotating the latent with cos/sin gathered by freq_index == rotating the keys."""
    w = _randn(G * d, X, seed=11)
    f = rope_factor(w, G, rank)
    L = 7
    y = _randn(L, X, seed=12)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 4095])
    cos, sin = _hf_cos_sin(positions, d)  # (L, d)
    P = f.rank // 2
    # latent pair p = dims (p, p + P) takes the key frequency freq_index[p]
    lat_cos = torch.cat([cos[:, f.freq_index], cos[:, f.freq_index]], dim=-1)  # (L, 2P)
    lat_sin = torch.cat([sin[:, f.freq_index], sin[:, f.freq_index]], dim=-1)
    assert lat_cos.shape == (L, 2 * P)
    c = y @ f.down.T  # (L, r)
    keys_from_rotated_latent = _rotate(c, lat_cos, lat_sin) @ f.up.T  # (L, G·d)
    approx_keys = (c @ f.up.T).reshape(L, G, d)  # the (possibly truncated) keys
    rotated_keys = _rotate(approx_keys, cos[:, None], sin[:, None]).reshape(L, G * d)
    assert _rel(keys_from_rotated_latent, rotated_keys) < F64_TOL
    if rank is None:  # and at full rank these are the true rotated keys
        true_keys = _rotate((y @ w.T).reshape(L, G, d), cos[:, None], sin[:, None]).reshape(L, G * d)
        assert _rel(keys_from_rotated_latent, true_keys) < F64_TOL


def test_rope_latent_with_wrong_frequencies_does_not_commute():
    """The commutation check above is sensitive: a shuffled freq_index breaks it."""
    G, d, X = 2, 8, 24
    f = rope_factor(_randn(G * d, X, seed=13), G)
    cos, sin = _hf_cos_sin(torch.arange(1, 9), d)
    wrong = f.freq_index.roll(1)
    c = _randn(8, X, seed=14) @ f.down.T
    via_latent = _rotate(c, torch.cat([cos[:, wrong]] * 2, -1), torch.cat([sin[:, wrong]] * 2, -1)) @ f.up.T
    via_keys = _rotate((c @ f.up.T).reshape(8, G, d), cos[:, None], sin[:, None]).reshape(8, -1)
    assert _rel(via_latent, via_keys) > 1e-2


def test_rope_factor_truncation_keeps_largest_complex_components():
    G, d, X = 3, 8, 30
    w = _randn(G * d, X, seed=15)
    full = rope_factor(w, G)
    f = rope_factor(w, G, rank=8)  # 4 complex components out of 4 freqs × 3
    assert f.rank == 8 and f.up.shape == (G * d, 8) and f.down.shape == (8, X)
    top = torch.sort(full.singular_values, descending=True).values[:4]
    assert torch.allclose(torch.sort(f.kept, descending=True).values, top, rtol=1e-12)
    assert f.retained_energy() < 1.0
    energy = float((top**2).sum() / (full.singular_values**2).sum())
    assert f.retained_energy() == pytest.approx(energy, rel=1e-12)
    # best rank-8 error among RoPE-compatible latents: the dropped components' energy
    err2 = float(((w - f.up @ f.down) ** 2).sum())
    dropped = torch.sort(full.singular_values, descending=True).values[4:]
    assert err2 == pytest.approx(float((dropped**2).sum()), rel=1e-9)


@pytest.mark.parametrize("factor", ["real", "joint", "rope"])
def test_float32_factorizations_reconstruct_to_float32_precision(factor):
    """A half-precision checkpoint's exact factorizations run in float32 (`work_dtype`, twice as
    fast as float64 at 8B scale): orthonormal up-projections and W reconstructed to float32's
    precision, a thousand times inside bfloat16's own rounding (2^-9); the RoPE latent keeps
    the same frequencies."""
    assert work_dtype(torch.bfloat16) == work_dtype(torch.float16) == torch.float32
    assert work_dtype(torch.float32) == work_dtype(torch.float64) == torch.float64
    G, d, X = 4, 16, 96
    w, v = _randn(G * d, X, seed=61).to(torch.bfloat16), _randn(G * d, X, seed=62).to(torch.bfloat16)
    if factor == "real":
        f, target = real_factor(w, dtype=torch.float32), w.double()
    elif factor == "joint":
        key_f, value_f = joint_factor(w, v, dtype=torch.float32)
        f, target = dataclasses.replace(key_f, up=torch.cat([key_f.up, value_f.up])), torch.cat([w, v]).double()
    else:
        f, target = rope_factor(w, G, dtype=torch.float32), w.double()
        assert torch.equal(f.freq_index, rope_factor(w.double(), G).freq_index)
    assert f.up.dtype == f.down.dtype == torch.float32
    assert _rel(f.up.double() @ f.down.double(), target) < 1e-5
    if factor != "rope":  # rope's up is the rotation blocks of unitary complex columns, scaled
        eye = torch.eye(f.rank, dtype=torch.float64)
        assert float((f.up.double().T @ f.up.double() - eye).abs().max()) < 1e-5


def test_rope_factor_refuses_odd_rank():
    with pytest.raises(ValueError):
        rope_factor(_randn(16, 24), 2, rank=5)


# ------------------------------------------------------------------ head maps


def _explicit_groups(H, G, head_map):
    if head_map == "grouped":
        return [h // (H // G) for h in range(H)]
    return [h % G for h in range(H)]


@pytest.mark.parametrize("H,G", [(6, 2), (6, 3), (4, 4), (8, 1), (12, 3)])
@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_group_of_head(H, G, head_map):
    assert group_of_head(H, G, head_map).tolist() == _explicit_groups(H, G, head_map)


def test_group_of_head_seed_example_and_unknown_map():
    # the seed's example: H = 12, G = 3, group 0 serves heads 0, 3, 6, 9
    g = group_of_head(12, 3, "tiled")
    assert torch.nonzero(g == 0).flatten().tolist() == [0, 3, 6, 9]
    assert torch.nonzero(group_of_head(12, 3, "grouped") == 0).flatten().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        group_of_head(4, 2, "interleaved")


@pytest.mark.parametrize("H,G,d", [(6, 2, 4), (4, 4, 3), (8, 1, 2), (12, 3, 5)])
def test_expand_groups_grouped_matches_repeat_kv(H, G, d):
    from transformers.models.llama.modeling_llama import repeat_kv

    X = 7
    per_group = _randn(G * d, X, seed=H)
    out = expand_groups(per_group, H, G, "grouped")
    assert out.shape == (H * d, X)
    # transformers' repeat_kv on keys (B, G, S, d): the per-head key each query head reads
    keys = per_group.reshape(G, d, X).permute(0, 2, 1)[None]  # (1, G, X, d)
    expected = repeat_kv(keys, H // G)[0].permute(0, 2, 1).reshape(H * d, X)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("H,G,d", [(6, 2, 4), (4, 4, 3), (8, 1, 2), (12, 3, 5)])
def test_expand_groups_tiled_is_seed_concatenation(H, G, d):
    X = 7
    per_group = _randn(G * d, X, seed=H + 1)
    expected = torch.from_numpy(np.concatenate([per_group.numpy()] * (H // G), axis=0))
    assert torch.equal(expand_groups(per_group, H, G, "tiled"), expected)
    assert torch.equal(tile_rows(per_group, H, G, "tiled"), expected)
    # and block by block, head h holds group h mod G
    blocks = expand_groups(per_group, H, G, "tiled").reshape(H, d, X)
    for h in range(H):
        assert torch.equal(blocks[h], per_group.reshape(G, d, X)[h % G])


def test_grouped_and_tiled_differ_for_true_gqa():
    per_group = _randn(2 * 3, 5)
    assert not torch.equal(expand_groups(per_group, 4, 2, "grouped"), expand_groups(per_group, 4, 2, "tiled"))


# ------------------------------------------------------------------ absorption


@pytest.mark.parametrize("H,d,r,X", [(4, 8, 6, 20), (3, 4, 12, 10), (1, 5, 5, 7)])
def test_absorb_query_preserves_scores(H, d, r, X):
    w_q = _randn(H * d, X, seed=21)
    up_k = _randn(H * d, r, seed=22)
    q_hat = absorb_query(w_q, up_k, H)
    assert q_hat.shape == (H * r, X)
    x, c = _randn(X, seed=23), _randn(r, seed=24)
    for h in range(H):
        q_h = w_q[h * d : (h + 1) * d] @ x  # original query of head h
        k_h = up_k[h * d : (h + 1) * d] @ c  # key of head h from the latent
        q_hat_h = q_hat[h * r : (h + 1) * r] @ x
        assert float(q_hat_h @ c) == pytest.approx(float(q_h @ k_h), rel=1e-12, abs=1e-12)
        # and the matrix itself is (W^{UK}_h)ᵀ W^Q_h
        expected = up_k[h * d : (h + 1) * d].T @ w_q[h * d : (h + 1) * d]
        assert _rel(q_hat[h * r : (h + 1) * r], expected) < F64_TOL


@pytest.mark.parametrize("H,d,r,D", [(4, 8, 6, 20), (3, 4, 12, 10), (1, 5, 5, 7)])
def test_absorb_output_preserves_output(H, d, r, D):
    w_o = _randn(D, H * d, seed=31)
    up_v = _randn(H * d, r, seed=32)
    o_hat = absorb_output(w_o, up_v, H)
    assert o_hat.shape == (D, H * r)
    c = _randn(H, r, seed=33)  # per head: the attention-weighted latent Σ α c
    original = sum(w_o[:, h * d : (h + 1) * d] @ (up_v[h * d : (h + 1) * d] @ c[h]) for h in range(H))
    absorbed = o_hat @ c.reshape(-1)
    assert _rel(absorbed, original) < F64_TOL
    for h in range(H):
        expected = w_o[:, h * d : (h + 1) * d] @ up_v[h * d : (h + 1) * d]
        assert _rel(o_hat[:, h * r : (h + 1) * r], expected) < F64_TOL


def test_absorb_query_carries_a_bias_column():
    H, d, r, X = 3, 4, 5, 9
    w_q, b_q, up_k = _randn(H * d, X, seed=41), _randn(H * d, seed=42), _randn(H * d, r, seed=43)
    aug = absorb_query(torch.cat([w_q, b_q[:, None]], dim=1), up_k, H)  # (H·r, X+1)
    assert aug.shape == (H * r, X + 1)
    x, c = _randn(X, seed=44), _randn(r, seed=45)
    for h in range(H):
        sl, sr = slice(h * d, (h + 1) * d), slice(h * r, (h + 1) * r)
        q_h = w_q[sl] @ x + b_q[sl]
        assert float((aug[sr, :-1] @ x + aug[sr, -1]) @ c) == pytest.approx(float(q_h @ (up_k[sl] @ c)), rel=1e-12)


def test_absorbed_products_in_blocks_of_heads_equal_the_one_block_products(monkeypatch):
    """Ŵ^Q and Ŵ^O computed a few heads at a time (a Llama-3-8B layer's would be 1 GiB at once)
    are the same numbers; cast as stored to bfloat16 they are the float64 products rounded,
    computed in float32 (an ulp apart at most, where a value sits on a rounding boundary)."""
    import convert.linalg.absorb as absorb

    H, d, r, X = 6, 8, 10, 20
    w_q, up_k = _randn(H * d, X, seed=51), _randn(H * d, r, seed=52)
    w_o, up_v = _randn(X, H * d, seed=53), _randn(H * d, r, seed=54)
    whole_q, whole_o = absorb_query(w_q, up_k, H), absorb_output(w_o, up_v, H)
    monkeypatch.setattr(absorb, "BLOCK_BYTES", 8 * r * X * 2)  # two heads per block
    assert torch.equal(absorb_query(w_q, up_k, H), whole_q) and torch.equal(absorb_output(w_o, up_v, H), whole_o)
    for got, want in (
        (absorb_query(w_q, up_k, H, torch.bfloat16), whole_q),
        (absorb_output(w_o, up_v, H, torch.bfloat16), whole_o),
    ):
        assert got.dtype == torch.bfloat16
        ulp = want.abs() * 2.0**-7  # bfloat16's spacing: 8 bits of mantissa
        assert bool(((got.double() - want).abs() <= ulp).all())
        assert float((got.double() - want.to(torch.bfloat16).double()).ne(0).double().mean()) < 0.02
