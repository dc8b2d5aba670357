"""Pure tensor-in, tensor-out math of the conversion: no files, no modules.

- `heads`: which key/value group each query head reads (the head map).
- `factor`: exact (and truncated) low-rank factorizations of the K/V projections.
- `rope`: the per-frequency complex latent that keeps RoPE keys exact.
- `absorb`: folding the up-projections into the query and output projections.
- `weighted`: weighted low-rank factorizations for compression below the exact rank
  (imported from `convert.linalg.weighted`, not re-exported here).
"""

from convert.linalg.absorb import absorb_output, absorb_query
from convert.linalg.factor import Factor, joint_factor, numerical_rank, real_factor, work_dtype
from convert.linalg.heads import expand_groups, group_of_head, tile_rows
from convert.linalg.rope import aligned_rope_factor, latent_groups, latent_ungroup, partial_rope_factor, rope_factor

__all__ = [
    "Factor",
    "absorb_output",
    "aligned_rope_factor",
    "absorb_query",
    "expand_groups",
    "group_of_head",
    "joint_factor",
    "latent_groups",
    "latent_ungroup",
    "numerical_rank",
    "real_factor",
    "partial_rope_factor",
    "rope_factor",
    "tile_rows",
    "work_dtype",
]
