"""The runnable converted model: MLA attention modules and a loader."""

from convert.mla.attention import MLAAttention, build_mla_attention, layer_tensors

__all__ = ["MLAAttention", "build_mla_attention", "layer_tensors"]
