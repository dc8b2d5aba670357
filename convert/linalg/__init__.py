"""Pure tensor-in, tensor-out math of the conversion: no files, no modules.

Head maps, exact factorizations and absorption are re-exported here; the weighted factorizations of compression are
imported from `convert.linalg.weighted`, not re-exported.
"""

from convert.linalg.absorb import absorb_output, absorb_query
from convert.linalg.factor import Factor, joint_factor, numerical_rank, real_factor, work_dtype
from convert.linalg.heads import expand_groups, group_of_head, tile_rows
from convert.linalg.rope_factor import (
    aligned_rope_factor,
    latent_groups,
    latent_ungroup,
    partial_rope_factor,
    rope_factor,
)

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
