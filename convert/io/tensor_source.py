"""`TensorSource`: the verbs every source of named tensors answers (a checkpoint, a state dict, a view of either).

Conversion, calibration and verification read tensors through these verbs only, whatever holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors: their names, shapes and dtypes (no data read), then their values.

    `read` and `read_rows` give values the caller may keep without pinning the source's memory: a
    file-backed source reads them into memory of their own (freed with the tensor, never a mapping
    left resident); an in-memory source gives its own tensor, or a view of it, so treat the result as
    read-only. `raw_span` is where the stored bytes are, for a file-to-file copy; None when the tensor
    has no bytes of its own on disk (it lives in memory, or a view assembles it from others).

    Beyond these, some sources have extras their callers need (not part of the protocol): `get` (the
    tensor without a copy: a file's copy-on-write mapping, an in-memory source's own tensor),
    `read_into` (straight into an existing tensor) and `raw_chunks` (stored bytes piece by piece).
    `isinstance(x, TensorSource)` checks that the methods exist, not their signatures.
    """

    def keys(self) -> list[str]:
        """Every tensor's name, in the source's order."""
        ...

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of `name`, without reading it."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of `name`, without reading it."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        ...

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of the first dimension of `name` (an embedding or lm_head in pieces);
        `stop` past the end is clamped, as slicing does."""
        ...

    def raw_span(self, name: str) -> tuple[Path, int, int] | None:
        """(file, offset, nbytes) of `name`'s stored bytes, or None where there are none to copy."""
        ...
