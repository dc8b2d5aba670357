"""Architecture registry: model family -> attention tensor names and conventions.

Data, not if-chains: adding a family that computes attention the Llama way is
one `ArchSpec` entry. `resolve_attention` turns a config (and CLI flags) plus
the tensor shapes into an `AttentionSpec`, refusing what it cannot convert.
"""

from convert.arch.registry import ARCHS, QK_NORM_MODEL_TYPES, ArchSpec, find_arch, tied_embeddings
from convert.arch.spec import AttentionSpec, GeometryFlags, resolve_attention

__all__ = [
    "ARCHS",
    "QK_NORM_MODEL_TYPES",
    "ArchSpec",
    "AttentionSpec",
    "GeometryFlags",
    "find_arch",
    "resolve_attention",
    "tied_embeddings",
]
