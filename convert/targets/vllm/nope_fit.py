"""The position-free stand-in for the rotations the vllm target cannot keep (docs/design.md, "Deployment targets").

The vllm export keeps one rotary mixture of the G key heads per frequency; the rest of each key loses its rotation, so
each head's position-free score is fitted by least squares on calibration text, with two fixed 2×2 maps per frequency.
"""

from typing import cast

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

SAMPLES = 32  # keys drawn per query (bench/vllm_variants.py compares 16)


def sample_keys(probs: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """(H, L, samples) key positions n drawn from each query's probabilities probs (H, L, L)."""
    H, L, _ = probs.shape
    flat = probs.reshape(H * L, L).float()  # (H·L, L)
    return torch.multinomial(flat, samples, replacement=True, generator=generator).reshape(H, L, samples)


def fit_normal_equations(
    q: torch.Tensor,
    r: torch.Tensor,
    k0: torch.Tensor,
    keys: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_freq: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares normal equations of the stand-in on the pairs (m, keys[h, m, s]):
    gram (H, 2d, 2d), rhs (H, 2d) float64, over the features [q_j·r_j | q_j×r_j] (position-free)
    and [q_j·R(-θ'_jΔ)k0_j | q_j×R(-θ'_jΔ)k0_j] (the rotary key, rotated as vLLM rotates it).

    q: (L, H, d) one window's pre-RoPE queries (rotate_half halves: pair j is (j, j + d/2));
    r: (L, H, d) each head's key remainder; k0: (L, d) the rotary key each pair's query meets
    (`rotary_mixture`, its slots repeated over the pairs folded into them); keys: (H, L, S) from
    `sample_keys`; inv_freq: (d/2,) the source's θ_j. Folded frequencies (head_dim > 64):
    rotary_freq (d/2,) the θ'_j vLLM turns pair j's rotary key by, and base (H, d/2) the rotary
    query's own coefficient u_j of each pair; the target then also carries what the rotary
    part misses by turning at θ'_j, Σ_j base_j q_j·(R(-θ_jΔ) - R(-θ'_jΔ)) k0_j. Default θ' = θ
    (that term is zero). Equations of several windows add up.
    """
    L, H, d = q.shape
    half = d // 2
    folded = rotary_freq is not None and not torch.equal(rotary_freq.double(), inv_freq.double())
    gram = torch.zeros(H, 2 * d, 2 * d, dtype=torch.float64)
    rhs = torch.zeros(H, 2 * d, dtype=torch.float64)
    m = torch.arange(L)[:, None]  # (L, 1)
    for h in range(H):  # one head at a time: its features are (L, S, 2d)
        n = keys[h]  # (L, S)
        qh, rh, kh = q[:, h].double(), r[n, h].double(), k0[n].double()  # (L, d), (L, S, d), (L, S, d)
        a, b = qh[:, None, :half], qh[:, None, half:]  # (L, 1, d/2)
        x, y = rh[..., :half], rh[..., half:]  # (L, S, d/2)
        delta = (m - n)[..., None].double()  # (L, S, 1)
        angle = delta * inv_freq.double()  # (L, S, d/2)
        cos, sin = angle.cos(), angle.sin()
        dot, cross = a * x + b * y, a * y - b * x  # (L, S, d/2)
        target = (cos * dot + sin * cross).sum(-1)  # (L, S): q·R(-θΔ)r over all j
        x0, y0 = kh[..., :half], kh[..., half:]
        if folded:
            assert rotary_freq is not None and base is not None  # folded: rotary_freq is given, and base with it
            angle_rot = delta * rotary_freq.double()  # (L, S, d/2)
            cos_rot, sin_rot = angle_rot.cos(), angle_rot.sin()
            exact = (cos * (a * x0 + b * y0) + sin * (a * y0 - b * x0)) * base[h].double()  # at θ
            target = target + exact.sum(-1)
        else:
            cos_rot, sin_rot = cos, sin
        x0, y0 = cos_rot * x0 + sin_rot * y0, cos_rot * y0 - sin_rot * x0  # R(-θ'Δ)k0
        rot_dot, rot_cross = a * x0 + b * y0, a * y0 - b * x0  # (L, S, d/2)
        if folded:
            assert base is not None  # folded: given with rotary_freq
            target = target - (rot_dot * base[h].double()).sum(-1)  # what vLLM's rotary part gives
        features = torch.cat([dot, cross, rot_dot, rot_cross], dim=-1).reshape(-1, 2 * d)  # (L·S, 2d)
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
    coef = _solve_psd(gram, rhs, unused)  # (H, 2d): [α | β | α' | β']
    return coef.reshape(H, 2, 2, half).transpose(-1, -2)  # (H, 2, d/2, 2)


def _slots(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """keys k (B, L, G, d) as (B, L, 2, slots, G·f): per rotary slot s its G·f components
    (group g, folded pair s·f + i) at index g·f + i, for unit rows u (slots, G·f)."""
    B, L, G, d = k.shape
    slots = u.shape[0]
    fold = d // 2 // slots
    pairs = k.reshape(B, L, G, 2, slots, fold)  # pair p = s·f + i; (first, second) halves
    return pairs.permute(0, 1, 3, 4, 2, 5).reshape(B, L, 2, slots, G * fold)


def _solve_psd(gram: torch.Tensor, rhs: torch.Tensor, fixed: torch.Tensor, ridge: float = 1e-12) -> torch.Tensor:
    """x (H, n) with (gram + ridge·mean(diag)·I) x = rhs per head, gram (H, n, n) positive
    semi-definite, the ridge left off the `fixed` (H, n) unknowns (identity rows): Cholesky (the
    ridge keeps collinear features solvable), least squares for a head whose factorization fails."""
    scale = gram.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True).clamp(min=1e-300)  # (H, 1)
    regular = gram + torch.diag_embed(ridge * scale * (~fixed).to(gram.dtype))
    factor, info = torch.linalg.cholesky_ex(regular)
    x = torch.cholesky_solve(rhs[..., None], factor)[..., 0]  # (H, n)
    for h in info.nonzero()[:, 0].tolist():
        x[h] = torch.linalg.lstsq(regular[h], rhs[h, :, None], driver="gelsd").solution[:, 0]
    return x


def rotary_mixture(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The keys' rotary key k0_s = Σ_c u_s[c] k_c over slot s's components c = (group g, folded
    pair s·f + i), (B, L, 2·slots) (first | second halves), for keys k (B, L, G, d) and unit rows
    u (slots, G·f), f = d / (2·slots) (f = 1: u_j over the groups of pair j)."""
    B, L = k.shape[:2]
    return torch.einsum("blpsc,sc->blps", _slots(k, u), u.to(k.dtype)).reshape(B, L, -1)


def key_remainder(k: torch.Tensor, u: torch.Tensor, mixture: torch.Tensor | None = None) -> torch.Tensor:
    """What of the keys k (B, L, G, d) stays position-free: per rotary slot s, minus the rotary
    key's share, r = (I - u_s u_sᵀ) k over the slot's components. u: (slots, G·f) unit rows;
    mixture: `rotary_mixture(k, u)` when the caller has it already."""
    B, L, G, d = k.shape
    slots = u.shape[0]
    fold = d // 2 // slots
    pairs = k.reshape(B, L, G, 2, slots, fold)
    mixture = rotary_mixture(k, u) if mixture is None else mixture
    along = mixture.reshape(B, L, 1, 2, slots, 1)  # u_sᵀk
    share = u.to(k.dtype).reshape(slots, G, fold).permute(1, 0, 2)[None, None, :, None]  # (1, 1, G, 1, slots, f)
    return (pairs - share * along).reshape(B, L, G, d)


def per_pair(rotary: torch.Tensor, fold: int) -> torch.Tensor:
    """A rotary key (..., 2·slots) (first | second halves) as the (..., d) each query pair meets:
    slot s repeated over its f folded pairs s·f + i."""
    first, second = rotary.chunk(2, dim=-1)
    return torch.cat([first.repeat_interleave(fold, -1), second.repeat_interleave(fold, -1)], dim=-1)


def rotary_coefficients(u: torch.Tensor, groups: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(H, d/2): head h's coefficient u_s[g(h)·f + i] of pair s·f + i in its rotary query, for
    unit rows u (slots, G·f) and each head's group `groups` (H,)."""
    slots, comps = u.shape
    fold = comps // n_kv_heads
    per_group = u.reshape(slots, n_kv_heads, fold)[:, groups]  # (slots, H, f)
    return per_group.permute(1, 0, 2).reshape(len(groups), slots * fold)


def attention_probabilities(attention: torch.nn.Module, x: torch.Tensor, rotary, mask) -> torch.Tensor:
    """The probabilities (B, H, L, L) of transformers' attention module `attention` (Llama
    family: q_proj, k_proj, `scaling`) on its normed input x (B, L, D), as its eager path."""
    B, L, _ = x.shape
    head_dim = attention.head_dim
    # cast: torch types a Module's attributes Tensor | Module
    q_proj, k_proj = cast(torch.nn.Module, attention.q_proj), cast(torch.nn.Module, attention.k_proj)
    q = q_proj(x).view(B, L, -1, head_dim).transpose(1, 2)  # (B, H, L, d)
    k = k_proj(x).view(B, L, -1, head_dim).transpose(1, 2)  # (B, G, L, d)
    cos, sin = rotary
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = repeat_kv(k, q.shape[1] // k.shape[1])  # (B, H, L, d)
    scores = q @ k.transpose(-1, -2) * attention.scaling  # (B, H, L, L)
    scores = scores + additive_mask(mask, L, scores.dtype).to(scores.device)
    return torch.softmax(scores.float(), dim=-1).to(x.dtype)


def additive_mask(mask: torch.Tensor | None, length: int, dtype: torch.dtype, keys: int | None = None) -> torch.Tensor:
    """An attention mask as the (..., L, S) float one added to the scores (S: `keys`, None: L): a bool
    mask (True: attend) as 0 / -inf, a float one as it is, None (transformers leaves a plain causal mask
    to its kernels) as the causal one (L = S only)."""
    if mask is None:
        if keys is not None and keys != length:
            raise ValueError(f"additive_mask: no causal mask for {length} queries of {keys} keys; pass the mask")
        return torch.full((length, length), float("-inf"), dtype=dtype).triu(1)
    mask = mask[..., :length, : length if keys is None else keys]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)
