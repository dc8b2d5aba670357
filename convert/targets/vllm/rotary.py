"""Which key directions keep their rotation: per rotary slot, the principal query-weighted mixture
of the key heads' pairs goes to `k_pe`; the rest of each key becomes position-free."""

import torch

from convert.arch import AttentionSpec
from convert.linalg.heads import group_of_head
from convert.rope.frequencies import fold
from convert.rope.rotation import rotate_half_pairs
from convert.targets.vllm.geometry import ROPE_DIM
from convert.targets.vllm.nope_fit import key_remainder, rotary_mixture
from convert.transform import LayerWeights


def rotary_direction(cov: torch.Tensor, weight: torch.Tensor, iterations: int = 100) -> torch.Tensor:
    """The unit u (G,) whose mixture uᵀk keeps the most query-weighted score energy.

    Head h's score loses q_h·R((I - uuᵀ)k)_{g(h)} to the dropped rotation; its energy,
    with W = diag(weight) the groups' query energy and C the key covariance, is
    tr(W (I-P) C (I-P)), P = uuᵀ: minimize -uᵀ(CW+WC)u + (uᵀWu)(uᵀCu) on the sphere by
    iterating u <- top eigenvector of its linearization (the best iterate is kept).
    Exact (zero loss) when the key heads are multiples of one vector.
    """
    W = torch.diag(weight)
    loss = lambda u: float(-u @ (cov @ W + W @ cov) @ u + (u @ W @ u) * (u @ cov @ u))
    u = torch.linalg.eigh(cov)[1][:, -1]
    best, best_loss = u, loss(u)
    for _ in range(iterations):
        A = cov @ W + W @ cov - (u @ cov @ u) * W - (u @ W @ u) * cov
        u = torch.linalg.eigh(A)[1][:, -1]
        if loss(u) < best_loss - 1e-15 * abs(best_loss):
            best, best_loss = u, loss(u)
        else:
            break
    return best


def _slot_rows(spec: AttentionSpec, slot: int, f: int) -> tuple[list[int], list[int]]:
    """Rows of slot s's components c = g·f + i (group g, pair s·f + i) in W^K (G·d, D): (first, second)."""
    d = spec.head_dim
    first, second = rotate_half_pairs(d)
    pairs = [slot * f + i for g in range(spec.n_kv_heads) for i in range(f)]
    offsets = [g * d for g in range(spec.n_kv_heads) for i in range(f)]
    return [o + int(first[p]) for o, p in zip(offsets, pairs)], [o + int(second[p]) for o, p in zip(offsets, pairs)]


def rotary_directions(
    w: LayerWeights, spec: AttentionSpec, moment: torch.Tensor | None, rope_dim: int = ROPE_DIM
) -> tuple[torch.Tensor, float | None]:
    """(u (rope_dim/2, G·f) float64 unit rows, the fraction of the key energy E‖k‖² they keep; None
    without a moment, when u is only a placeholder: the export refuses to go on uncalibrated).

    Slot s of the `rope_dim` rotary dims (vLLM's 64) turns at the source's θ_{s·f}; its G·f components
    are the G key heads' pairs s·f + i (i < f, f = d/rope_dim: FreqFold for d = 128 in vLLM). Their covariance
    C_s[c, c'] = tr(K_c M K_{c'}ᵀ) (K_c the component's 2 rows of W^K, M = E[x xᵀ]) and the
    query energy w_c of the heads that read c: `rotary_direction`. One component: u = 1, exact.
    """
    G, d, H = spec.n_kv_heads, spec.head_dim, spec.n_heads
    f, slots = fold(d, rope_dim), rope_dim // 2
    if G * f == 1:
        return torch.ones(slots, 1, dtype=torch.float64), 1.0
    if moment is None:
        return torch.eye(G * f, dtype=torch.float64)[:1].expand(slots, -1).contiguous(), None
    k = w.k.double()  # (G·d, D)
    q = w.q.double().reshape(H, d, -1)  # (H, d, D)
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    M = moment.double()  # (D, D)
    first, second = rotate_half_pairs(d)
    pair_energy = torch.einsum("hpd,de,hpe->hp", q, M, q)  # (H, d): each query row's energy
    pair_energy = pair_energy[:, first] + pair_energy[:, second]  # (H, d/2)
    per_group = torch.zeros(G, d // 2, dtype=torch.float64).index_add_(0, groups, pair_energy)  # (G, d/2)
    out = torch.empty(slots, G * f, dtype=torch.float64)
    kept = total = 0.0
    for slot in range(slots):
        rows_first, rows_second = _slot_rows(spec, slot, f)
        ks = torch.stack([k[rows_first], k[rows_second]], dim=1)  # (G·f, 2, D)
        cov = torch.einsum("cid,de,bie->cb", ks, M, ks)  # (G·f, G·f)
        weight = per_group[:, slot * f : (slot + 1) * f].reshape(G * f)  # (G·f,) component c = g·f + i
        out[slot] = rotary_direction(cov, weight / weight.sum())
        kept, total = kept + float(out[slot] @ cov @ out[slot]), total + float(cov.trace())
    return out, kept / total


def rotary_key_weights(key: torch.Tensor, spec: AttentionSpec, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key: W^K (G·d, D) (or a bias (G·d, 1)) -> (k0 (rope_dim, D): the rotary key's rows, first | second
    halves; r (G·d, D): W^K less its share of the rotary key, in W^K's row layout) —
    `rotary_mixture`/`key_remainder` on the weights."""
    G, d = spec.n_kv_heads, spec.head_dim
    hidden = key.shape[1]
    k = key.double().T.reshape(1, hidden, G, d)  # the weight's columns as (1, D, G, d) "keys"
    mixture = rotary_mixture(k, u)  # (1, D, rope_dim)
    k0 = mixture[0].T  # (rope_dim, D)
    r = key_remainder(k, u, mixture)[0].reshape(hidden, G * d).T  # (G·d, D)
    return k0, r
