"""What config.json says of RoPE, read as transformers reads it (no torch: the CLI's light path reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

#: The fields that hold RoPE parameters: transformers 5's, then the older one it still reads.
FIELDS = ("rope_parameters", "rope_scaling")


def rope_type(config: Mapping[str, Any]) -> str:
    """The RoPE type config.json names (transformers 5's ``rope_parameters``, else the older ``rope_scaling``,
    ``rope_type`` or its older ``type``), ``default`` when it names none."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    # cast: config.json's values are untyped (mypy reads a get with an Any default as possibly None)
    return cast(str, rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"


def parameter_sets(config: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """(field, parameters) of every RoPE parameter set: rope_parameters and rope_scaling, and per
    layer type where transformers 5 nests them (types already checked by `check_config`)."""
    found: list[tuple[str, dict]] = []
    for field in FIELDS:
        params = config.get(field) or {}
        nested = params and all(isinstance(v, dict) for v in params.values())
        found += [(f"{field}.{k}", v) for k, v in params.items()] if nested else [(field, params)]
    return found
