"""A source's attention geometry as transformers reads it from config.json, with transformers' defaults.

The published configs leave some of it out (Qwen2/2.5 and Llama up to 3 carry no ``head_dim``; a
config without ``num_key_value_heads`` is multi-head attention), so every reader of the geometry
asks here rather than repeating the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def n_kv_heads(config: Mapping[str, Any]) -> int:
    """Key/value heads: ``num_key_value_heads``, else one per query head (transformers' default)."""
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def head_dim(config: Mapping[str, Any]) -> int:
    """Dims per head: ``head_dim``, else ``hidden_size // num_attention_heads`` (transformers' default)."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def head_dim_if_known(config: Mapping[str, Any]) -> int | None:
    """`head_dim`, or None when config.json has neither ``head_dim`` nor the fields it defaults from."""
    if config.get("head_dim") is None and ("hidden_size" not in config or "num_attention_heads" not in config):
        return None
    return head_dim(config)
