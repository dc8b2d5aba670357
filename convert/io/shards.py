"""Shard planning for the writer: where each planned tensor goes, and each shard's header.

The whole layout is fixed before the first byte is written, so tensors can then arrive in any order.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from convert.errors import ConvertError
from convert.io.header import TORCH_TO_SAFETENSORS, dtype_itemsize
from convert.io.locate import SINGLE_NAME


@dataclass
class Slot:
    """Where one planned tensor goes."""

    shard: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # absolute offset in the shard file
    nbytes: int = 0


@dataclass
class Shard:
    """One output file: its tensors in data order and its total size."""

    names: list[str] = field(default_factory=list)
    data_bytes: int = 0
    filename: str = ""
    file_size: int = 0


def shard_filename(index: int, count: int) -> str:
    """The name of shard `index` of `count`, as transformers names them (one shard: model.safetensors)."""
    if count == 1:
        return SINGLE_NAME
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """The safetensors metadata every shard carries: `metadata` with format=pt (transformers refuses
    files whose metadata lacks it); ConvertError for a key or value that is not a string."""
    merged = {"format": "pt", **(metadata or {})}
    for key, value in merged.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConvertError(
                f"safetensors metadata {key!r}: keys and values must be strings; convert them with str()"
            )
    return merged


def plan_slots(plan: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Slot]:
    """A slot (shape, dtype, size; no shard yet) for every planned tensor, in plan order."""
    slots: dict[str, Slot] = {}
    for name, (shape, dtype) in plan.items():
        if name == "__metadata__":
            raise ConvertError("tensor name '__metadata__' is reserved by safetensors; rename the tensor")
        if dtype not in TORCH_TO_SAFETENSORS:
            raise ConvertError(
                f"tensor '{name}': dtype {dtype} cannot be stored in safetensors; cast it to float32, float16 or bfloat16"
            )
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ConvertError(f"tensor '{name}': negative dimension in planned shape {shape}; fix the plan")
        nbytes = math.prod(shape) * dtype_itemsize(dtype)
        slots[name] = Slot(shard=-1, shape=shape, dtype=dtype, nbytes=nbytes)
    return slots


def assign_shards(slots: dict[str, Slot], max_shard_size: int) -> list[Shard]:
    """Shards in plan order: a new one starts when the next tensor would push the current one past
    `max_shard_size` bytes (a larger tensor gets a shard of its own). Sets each slot's shard. An
    empty plan has no shard (the llamacpp target's weights are a file of another format)."""
    if not slots:
        return []
    shards = [Shard()]
    for name, slot in slots.items():
        current = shards[-1]
        if current.names and current.data_bytes + slot.nbytes > max_shard_size:
            current = Shard()
            shards.append(current)
        current.names.append(name)
        current.data_bytes += slot.nbytes
        slot.shard = len(shards) - 1
    for i, shard in enumerate(shards):
        shard.filename = shard_filename(i, len(shards))
    return shards


def header_bytes(shard: Shard, slots: dict[str, Slot], metadata: dict[str, str]) -> bytes:
    """Lay out ``shard``'s tensors (their slots' offsets, relative to the data area) and return its
    padded header (length prefix included)."""
    # Largest item size first keeps every tensor aligned to its element
    # size (the data section starts at a multiple of 8), as safetensors does.
    ordered = sorted(shard.names, key=lambda n: -dtype_itemsize(slots[n].dtype))
    shard.names = ordered
    header: dict[str, Any] = {"__metadata__": metadata}
    cursor = 0
    for name in ordered:
        slot = slots[name]
        header[name] = {
            "dtype": TORCH_TO_SAFETENSORS[slot.dtype],
            "shape": list(slot.shape),
            "data_offsets": [cursor, cursor + slot.nbytes],
        }
        slot.offset = cursor  # relative for now; the writer makes it absolute
        cursor += slot.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
