"""The runnable converted model: MLA attention modules and a loader."""

from convert.mla.attention import MLAAttention

__all__ = ["MLAAttention"]
