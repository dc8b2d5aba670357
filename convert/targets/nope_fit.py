"""The position-free stand-in for the rotations the vllm target cannot keep (DESIGN §10).

For G > 1 key heads, per frequency j the vllm export keeps one mixture u_jᵀk of the G heads'
rotary pairs rotary; the remainder r_g = ((I - u uᵀ) k)_g (a 2-vector per group and frequency)
becomes position-free: head h's score term q_hᵀ R(-θ_j Δ) r_g (Δ = m - n, the query's position
minus the key's) must be replaced by a fixed bilinear form q_hᵀ M r_g. Keeping it unrotated is
M = I, right only at Δ = 0. The best fixed M of the rotation's form,
M = [[α, β], [-β, α]] (q_hᵀ M r = α q·r + β q×r), is fitted per layer, head and frequency by
least squares over the calibration text, each (m, n) weighted by the original model's
attention probability P(m, n). (Removing each query's P-weighted mean error first, which its
softmax ignores, measured slightly worse on a dev text: perplexity ×1.167 against ×1.159.)

Every sum Σ_{m,n} P(m,n) f(m) g(n) here is separable: cos θ(m-n) = cos θm cos θn + sin θm sin θn,
so one batched product P @ K (K: the key-side factors) gives them all, never an
(m, n, frequency) tensor.
"""

import torch


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """θ_j of default RoPE, (d/2,) float64: pair j = (j, j + d/2) turns by θ_j per position."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _times(f: dict, g: dict) -> dict:
    """Product of two separable functions {key atoms: query factor} (Σ_k Q_k(m) K_k(n))."""
    out: dict = {}
    for key_f, query_f in f.items():
        for key_g, query_g in g.items():
            key = tuple(sorted(key_f + key_g))
            out[key] = out[key] + query_f * query_g if key in out else query_f * query_g
    return out


def _plus(*fs: dict) -> dict:
    out: dict = {}
    for f in fs:
        for key, query in f.items():
            out[key] = out[key] + query if key in out else query
    return out


def fit_sums(q: torch.Tensor, r: torch.Tensor, probs: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Normal-equation sums of the fit, (H, d/2, 5) float64: Σ f1², Σ f1 f2, Σ f2²,
    Σ t f1, Σ t f2 with f1 = q·r, f2 = q×r, t = q·R(-θΔ)r, each P-weighted over (m, n).

    q: (B, L, H, d) pre-RoPE queries (rotate_half halves: pair j is (j, j + d/2)); r: (B, L, H, d)
    each head's key remainder; probs: (B, H, L, L) the original's attention probabilities;
    inv_freq: (d/2,) θ_j. Sums over windows add up.
    """
    half = q.shape[-1] // 2
    work = probs.dtype
    angle = torch.arange(q.shape[1], dtype=torch.float64)[:, None] * inv_freq.double()[None]  # (L, d/2)
    cos, sin = angle.cos().to(work), angle.sin().to(work)  # (L, d/2)
    a, b = q[..., :half].to(work), q[..., half:].to(work)  # (B, L, H, d/2)
    atoms = {
        "x": r[..., :half].to(work),
        "y": r[..., half:].to(work),
        "c": cos[None, :, None],
        "s": sin[None, :, None],
    }  # key side: r's pair, cos θn, sin θn
    f1 = {("x",): a, ("y",): b}  # q·r
    f2 = {("y",): a, ("x",): -b}  # q×r = a y - b x
    cos_m, sin_m = cos[None, :, None], sin[None, :, None]  # (1, L, 1, d/2)
    cos_d = {("c",): cos_m, ("s",): sin_m}  # cos θ(m-n) = cos θm cos θn + sin θm sin θn
    sin_d = {("c",): sin_m, ("s",): -cos_m}  # sin θ(m-n) = sin θm cos θn - cos θm sin θn
    t = _plus(_times(cos_d, f1), _times(sin_d, f2))  # q·R(-θΔ)r = cos θΔ f1 + sin θΔ f2
    products = [_times(f1, f1), _times(f1, f2), _times(f2, f2), _times(t, f1), _times(t, f2)]
    keys = sorted({key for f in products for key in f})
    key_index = {key: i for i, key in enumerate(keys)}
    B, L, H, _ = a.shape
    key_vectors = torch.empty(B, L, H, len(keys), half, dtype=work)  # (B, L, H, k, d/2)
    for key, i in key_index.items():
        vector = torch.ones((), dtype=work)
        for atom in key:
            vector = vector * atoms[atom]
        key_vectors[:, :, :, i] = vector.expand(B, L, H, half)
    # P @ K per window and head: (B, H, L, L) @ (B, H, L, k·d/2)
    weighted = probs @ key_vectors.permute(0, 2, 1, 3, 4).reshape(B, H, L, -1)
    weighted = weighted.reshape(B, H, L, len(keys), half).permute(0, 2, 1, 3, 4)  # (B, L, H, k, d/2)
    # Σ_m Σ_n P(m,n) f(m,n) = Σ_m Σ_k Q_k(m) (P K_k)(m), accumulated in float64
    sums = [
        sum((query * weighted[:, :, :, key_index[key]]).double().sum(dim=(0, 1)) for key, query in f.items())
        for f in products
    ]  # each (H, d/2)
    return torch.stack(sums, dim=-1)  # (H, d/2, 5)


def fit_rotation_stand_in(sums: torch.Tensor) -> torch.Tensor:
    """(α, β) per head and frequency (H, d/2, 2) from `fit_sums`; (1, 0), the unrotated
    terms, where the fit is singular (a frequency whose remainder is zero)."""
    s11, s12, s22, t1, t2 = sums.unbind(-1)
    det = s11 * s22 - s12 * s12
    ok = det > 1e-12 * (s11 * s22).clamp_min(torch.finfo(torch.float64).tiny)
    safe = torch.where(ok, det, torch.ones_like(det))
    alpha = torch.where(ok, (t1 * s22 - t2 * s12) / safe, torch.ones_like(det))
    beta = torch.where(ok, (s11 * t2 - s12 * t1) / safe, torch.zeros_like(det))
    return torch.stack([alpha, beta], dim=-1)


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
