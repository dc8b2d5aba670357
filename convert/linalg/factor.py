"""Low-rank factorizations `W = up @ down` of key/value projections (docs/math.md, "The exact factorization").

Each factors the small (G·d × D) matrix, never the tiled (H·d × D) one: the same row space at H/G times less work. They
run in float64, or in float32 where a caller asks (`work_dtype`); callers cast at the end.
"""

from dataclasses import dataclass

import torch


@dataclass
class Factor:
    """`weight ≈ up @ down` with `up` (m × r) and `down` (r × X).

    `singular_values` holds every singular value of the factored matrix and
    `kept` the ones the factorization keeps, so callers can report the retained
    energy. `freq_index` is set for RoPE key latents: latent pair p (dims p and
    p + r/2, rotate_half layout) rotates with original frequency `freq_index[p]`.
    """

    up: torch.Tensor
    down: torch.Tensor
    singular_values: torch.Tensor
    kept: torch.Tensor
    freq_index: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def retained_energy(self) -> float:
        """Fraction of the squared Frobenius norm the kept singular values carry."""
        total = float((self.singular_values**2).sum())
        return 1.0 if total == 0 else float((self.kept**2).sum()) / total


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the exact factorizations and products behind tensors stored in `dtype`:
    float64, or float32 for a half-precision checkpoint. Its own rounding (float16: 2^-11
    relative, bfloat16: 2^-8) is ~10^3 times float32's: an orthonormal basis from a float32
    eigendecomposition reconstructs W to ~1e-6, products over d = 128 terms carry ~7e-7.
    float64 would take longer for the same stored values, bar an ulp where a value sits on a
    rounding boundary. Compression (`convert.linalg.weighted`) always runs in float64."""
    return torch.float64 if torch.finfo(dtype).bits >= 32 else torch.float32


def exact_rank(weight_rows: int, in_features: int) -> int:
    """The rank at which a (rows × in) factorization is exact for any weights."""
    return min(weight_rows, in_features)


def numerical_rank(weight: torch.Tensor) -> int:
    """Rank of `weight` with numpy's default tolerance, computed in float64."""
    s = torch.linalg.svdvals(weight.double())
    if s.numel() == 0 or s[0] == 0:
        return 0
    tol = s[0] * max(weight.shape) * torch.finfo(torch.float64).eps
    return int((s > tol).sum())


def real_factor(weight: torch.Tensor, rank: int | None = None, dtype: torch.dtype = torch.float64) -> Factor:
    """SVD factorization `weight = U_r (S_r V_rᵀ)`; exact when `rank` is None.

    weight: (m, X). Returns up (m, r), down (r, X) with down = S Vᵀ, as the seed's
    Part 9 (`W^{DKV} = diag(σ) Vᵀ`, `W^{UM} = U`), computed in `dtype` (`work_dtype`).
    """
    w = weight.to(dtype)
    r = exact_rank(*w.shape) if rank is None else rank
    if w.shape[0] > w.shape[1]:  # tall: the Gram trick below would square a bigger matrix
        u, s, vh = torch.linalg.svd(w, full_matrices=False)  # u (m,k) s (k,) vh (k,X)
        return Factor(up=u[:, :r], down=s[:r, None] * vh[:r], singular_values=s, kept=s[:r])
    # Wide (G·d ≤ D, every real K/V projection): U from the eigenvectors of the small
    # (m × m) Gram matrix W Wᵀ = U S² Uᵀ, then down = Uᵀ W (= S Vᵀ) — faster than a full SVD
    # (bench/factorization.py measures it), and exact at full rank because U is an orthonormal basis.
    vals, vecs = torch.linalg.eigh(w @ w.T)  # ascending
    u, s = vecs.flip(-1), vals.flip(0).clamp(min=0).sqrt()  # descending
    return Factor(up=u[:, :r], down=u[:, :r].T @ w, singular_values=s, kept=s[:r])


def joint_factor(
    key: torch.Tensor, value: torch.Tensor, rank: int | None = None, dtype: torch.dtype = torch.float64
) -> tuple[Factor, Factor]:
    """One shared latent for keys and values (seed Part 14, DeepSeek's `W^{DKV}`).

    SVD of the stacked `[W^K; W^V]` (2G·d × D) in `dtype`. Exact at its numerical rank (found
    in float64), the default. Returns the key factor and the value factor; they share `down`.
    """
    stacked = torch.cat([key, value])  # (2G·d, D)
    r = numerical_rank(stacked) if rank is None else rank
    both = real_factor(stacked, r, dtype)
    n_key_rows = key.shape[0]
    key_f = Factor(both.up[:n_key_rows], both.down, both.singular_values, both.kept)
    value_f = Factor(both.up[n_key_rows:], both.down, both.singular_values, both.kept)
    return key_f, value_f
