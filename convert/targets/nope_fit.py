"""The position-free stand-in for the rotations the vllm target cannot keep (DESIGN §10).

For G > 1 key heads, per frequency j the vllm export keeps one mixture u_jᵀk of the G heads'
rotary pairs rotary; the remainder r_g = ((I - u uᵀ) k)_g (a 2-vector per group and frequency)
becomes position-free: head h's score term q_jᵀ R(-θ_j Δ) r_j (Δ = m - n, the query's position
minus the key's) must be replaced by a fixed bilinear form q_jᵀ M_j r_j. Keeping it unrotated is
M_j = I, right only at Δ = 0. Here M_j = [[α_j, β_j], [-β_j, α_j]] (q_jᵀ M_j r_j = α_j q_j·r_j +
β_j q_j×r_j), all frequencies of a head fitted together to the head's whole position-free score

    t(m, n) = Σ_j q_j(m)ᵀ R(-θ_j (m - n)) r_j(n)   ≈   Σ_j α_j q_j·r_j + β_j q_j×r_j,

which is what its softmax sees (errors of different frequencies add, or cancel), by least
squares over (query, key) pairs of the calibration text drawn from the original model's
attention probabilities P(m, ·): `SAMPLES` keys per query, a seeded draw — in expectation the
P-weighted fit over all pairs, at a fraction of its cost (its normal equations need every
frequency pair's products over all L² pairs). SmolLM2, dev text (bench/vllm_variants.py):
perplexity ×1.13, against ×1.36 unrotated (and ×1.16 with each frequency fitted on its own, as
commit 7d92623 did).
"""

import torch

SAMPLES = 32  # keys drawn per query (bench/vllm_variants.py compares 128)


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """θ_j of default RoPE, (d/2,) float64: pair j = (j, j + d/2) turns by θ_j per position."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def sample_keys(probs: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """(H, L, samples) key positions n drawn from each query's probabilities probs (H, L, L)."""
    H, L, _ = probs.shape
    flat = probs.reshape(H * L, L).float()  # (H·L, L)
    return torch.multinomial(flat, samples, replacement=True, generator=generator).reshape(H, L, samples)


def fit_normal_equations(
    q: torch.Tensor, r: torch.Tensor, keys: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares normal equations of the stand-in on the pairs (m, keys[h, m, s]):
    gram (H, d, d), rhs (H, d) float64, over the features [q_j·r_j for j | q_j×r_j for j].

    q: (L, H, d) one window's pre-RoPE queries (rotate_half halves: pair j is (j, j + d/2));
    r: (L, H, d) each head's key remainder; keys: (H, L, S) from `sample_keys`; inv_freq: (d/2,).
    Equations of several windows add up.
    """
    L, H, d = q.shape
    half = d // 2
    gram = torch.zeros(H, d, d, dtype=torch.float64)
    rhs = torch.zeros(H, d, dtype=torch.float64)
    m = torch.arange(L)[:, None]  # (L, 1)
    for h in range(H):  # one head at a time: its features are (L, S, d)
        n = keys[h]  # (L, S)
        qh, rh = q[:, h].double(), r[n, h].double()  # (L, d), (L, S, d)
        a, b = qh[:, None, :half], qh[:, None, half:]  # (L, 1, d/2)
        x, y = rh[..., :half], rh[..., half:]  # (L, S, d/2)
        dot, cross = a * x + b * y, a * y - b * x  # (L, S, d/2)
        angle = (m - n)[..., None].double() * inv_freq.double()  # (L, S, d/2)
        target = (angle.cos() * dot + angle.sin() * cross).sum(-1)  # (L, S): q·R(-θΔ)r over all j
        features = torch.cat([dot, cross], dim=-1).reshape(-1, d)  # (L·S, d)
        gram[h] = features.T @ features
        rhs[h] = features.T @ target.reshape(-1)
    return gram, rhs


def fit_rotation_stand_in(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(α, β) per head and frequency (H, d/2, 2) from `fit_normal_equations`. A frequency whose
    remainder is zero on every pair (its features vanish) gets (1, 0), the unrotated terms."""
    H, d, _ = gram.shape
    unused = gram.diagonal(dim1=1, dim2=2) <= 1e-300  # (H, d): features that are zero everywhere
    default = torch.cat([torch.ones(d // 2), torch.zeros(d // 2)]).double()  # (α, β) = (1, 0)
    gram = gram + torch.diag_embed(unused.double())
    rhs = torch.where(unused, default, rhs)
    coef = torch.linalg.solve(gram, rhs[..., None])[..., 0]  # (H, d): [α_j | β_j]
    return torch.stack([coef[:, : d // 2], coef[:, d // 2 :]], dim=-1)


def key_remainder(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """What of the keys k (B, L, G, d) stays position-free: per frequency j, minus the rotary
    mixture's share, r = (I - u_j u_jᵀ) k over the group index. u: (d/2, G) unit rows."""
    B, L, G, d = k.shape
    pairs = k.reshape(B, L, G, 2, d // 2)  # (first, second) halves of each pair
    along = torch.einsum("blgph,hg->blph", pairs, u.to(k.dtype))  # (B, L, 2, d/2): u_jᵀk
    return (pairs - u.T.to(k.dtype)[None, None, :, None, :] * along[:, :, None]).reshape(B, L, G, d)


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
