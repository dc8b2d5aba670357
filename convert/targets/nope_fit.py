"""The position-free stand-in for the rotations the vllm target cannot keep (DESIGN §10).

For G > 1 key heads, per frequency j the vllm export keeps one mixture k0_j = u_jᵀk of the G
heads' rotary pairs rotary; the remainder r_g = ((I - u uᵀ) k)_g (a 2-vector per group and
frequency) becomes position-free: head h's score term q_jᵀ R(-θ_j Δ) r_j (Δ = m - n, the query's
position minus the key's) must be replaced by what the export can compute. Keeping it unrotated
(q_jᵀ r_j) is right only at Δ = 0. Here each head's whole position-free score

    t(m, n) = Σ_j q_j(m)ᵀ R(-θ_j (m - n)) r_j(n)

is fitted by two fixed maps per frequency of the rotation's form [[α, β], [-β, α]] (which
commute with R): one on the position-free terms, α_j q_j·r_j + β_j q_j×r_j, and one added to
the rotary query, α'_j q_j·R k0_j + β'_j q_j×R k0_j — the rotary key rotates exactly, and
carries what of the remainder is correlated with it. All frequencies of a head are fitted
together (errors of different frequencies add, or cancel, in the softmax), by least squares over
(query, key) pairs of the calibration text drawn from the original model's attention
probabilities P(m, ·): `SAMPLES` keys per query, a seeded draw — in expectation the P-weighted
fit over all pairs, at a fraction of its cost. SmolLM2, dev text (bench/vllm_variants.py):
perplexity ×1.05, against ×1.36 unrotated; the position-free map alone, each frequency fitted on
its own, measured ×1.16 (commit 7d92623), fitted jointly ×1.13 (commit 08b3c6c).
"""

import torch

SAMPLES = 32  # keys drawn per query (bench/vllm_variants.py compares 16)


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """θ_j of default RoPE, (d/2,) float64: pair j = (j, j + d/2) turns by θ_j per position."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def sample_keys(probs: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """(H, L, samples) key positions n drawn from each query's probabilities probs (H, L, L)."""
    H, L, _ = probs.shape
    flat = probs.reshape(H * L, L).float()  # (H·L, L)
    return torch.multinomial(flat, samples, replacement=True, generator=generator).reshape(H, L, samples)


def fit_normal_equations(
    q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, keys: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares normal equations of the stand-in on the pairs (m, keys[h, m, s]):
    gram (H, 2d, 2d), rhs (H, 2d) float64, over the features [q_j·r_j | q_j×r_j] (position-free)
    and [q_j·R(-θ_jΔ)k0_j | q_j×R(-θ_jΔ)k0_j] (the rotary mixture, rotated as vLLM rotates it).

    q: (L, H, d) one window's pre-RoPE queries (rotate_half halves: pair j is (j, j + d/2));
    r: (L, H, d) each head's key remainder; k0: (L, d) the rotary mixture (`rotary_mixture`);
    keys: (H, L, S) from `sample_keys`; inv_freq: (d/2,). Equations of several windows add up.
    """
    L, H, d = q.shape
    half = d // 2
    gram = torch.zeros(H, 2 * d, 2 * d, dtype=torch.float64)
    rhs = torch.zeros(H, 2 * d, dtype=torch.float64)
    m = torch.arange(L)[:, None]  # (L, 1)
    for h in range(H):  # one head at a time: its features are (L, S, 2d)
        n = keys[h]  # (L, S)
        qh, rh, kh = q[:, h].double(), r[n, h].double(), k0[n].double()  # (L, d), (L, S, d), (L, S, d)
        a, b = qh[:, None, :half], qh[:, None, half:]  # (L, 1, d/2)
        x, y = rh[..., :half], rh[..., half:]  # (L, S, d/2)
        angle = (m - n)[..., None].double() * inv_freq.double()  # (L, S, d/2)
        cos, sin = angle.cos(), angle.sin()
        dot, cross = a * x + b * y, a * y - b * x  # (L, S, d/2)
        target = (cos * dot + sin * cross).sum(-1)  # (L, S): q·R(-θΔ)r over all j
        x0, y0 = cos * kh[..., :half] + sin * kh[..., half:], cos * kh[..., half:] - sin * kh[..., :half]  # R(-θΔ)k0
        features = torch.cat([dot, cross, a * x0 + b * y0, a * y0 - b * x0], dim=-1).reshape(-1, 2 * d)  # (L·S, 2d)
        gram[h] = features.T @ features
        rhs[h] = features.T @ target.reshape(-1)
    return gram, rhs


def fit_rotation_stand_in(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(H, 2, d/2, 2) from `fit_normal_equations`: [:, 0] the position-free terms' (α, β),
    [:, 1] the (α', β') of the map added to the rotary query. A feature that is zero on every
    pair (a frequency with no remainder) gets (1, 0) position-free, (0, 0) rotary."""
    H, features, _ = gram.shape
    half = features // 4
    unused = gram.diagonal(dim1=1, dim2=2) <= 1e-300  # (H, 2d): features that are zero everywhere
    default = torch.zeros(features, dtype=torch.float64)
    default[:half] = 1.0  # α of the position-free terms: unrotated
    gram = gram + torch.diag_embed(unused.double())
    rhs = torch.where(unused, default, rhs)
    coef = torch.linalg.solve(gram, rhs[..., None])[..., 0]  # (H, 2d): [α | β | α' | β']
    return coef.reshape(H, 2, 2, half).transpose(-1, -2)  # (H, 2, d/2, 2)


def rotary_mixture(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The keys' rotary mixture k0_j = Σ_g u_j[g] k_g[pair j], (B, L, d) (first | second halves),
    for keys k (B, L, G, d) and unit rows u (d/2, G)."""
    B, L, G, d = k.shape
    pairs = k.reshape(B, L, G, 2, d // 2)  # (first, second) halves of each pair
    return torch.einsum("blgph,hg->blph", pairs, u.to(k.dtype)).reshape(B, L, d)


def key_remainder(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """What of the keys k (B, L, G, d) stays position-free: per frequency j, minus the rotary
    mixture's share, r = (I - u_j u_jᵀ) k over the group index. u: (d/2, G) unit rows."""
    B, L, G, d = k.shape
    pairs = k.reshape(B, L, G, 2, d // 2)
    along = rotary_mixture(k, u).reshape(B, L, 1, 2, d // 2)  # u_jᵀk
    return (pairs - u.T.to(k.dtype)[None, None, :, None, :] * along).reshape(B, L, G, d)


def attention_probabilities(attention: torch.nn.Module, x: torch.Tensor, rotary, mask) -> torch.Tensor:
    """The probabilities (B, H, L, L) of transformers' attention module `attention` (Llama
    family: q_proj, k_proj, `scaling`) on its normed input x (B, L, D), as its eager path."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    B, L, _ = x.shape
    head_dim = attention.head_dim
    q = attention.q_proj(x).view(B, L, -1, head_dim).transpose(1, 2)  # (B, H, L, d)
    k = attention.k_proj(x).view(B, L, -1, head_dim).transpose(1, 2)  # (B, G, L, d)
    cos, sin = rotary
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = repeat_kv(k, q.shape[1] // k.shape[1])  # (B, H, L, d)
    scores = q @ k.transpose(-1, -2) * attention.scaling  # (B, H, L, L)
    if mask is None:  # transformers leaves a plain causal mask to its kernels
        mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    mask = mask[..., :L, :L]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores.float(), dim=-1).to(x.dtype)
