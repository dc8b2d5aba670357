"""The checkpoint reader (`Checkpoint`, `open_checkpoint`): a single file, a sharded directory or an HF model dir
(a GGUF file opens as a `convert.io.gguf.GGUFCheckpoint`).

Every header is checked at open (`convert.io.header`); tensor data is read later, one tensor at a time, on demand.
It is a `convert.io.tensor_source.TensorSource`, with file-only extras (`get`, `read_into`, `raw_chunks`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from convert.errors import ConvertError
from convert.io.gguf import GGUFCheckpoint, tokenizer_files
from convert.io.gguf_header import is_gguf
from convert.io.header import (
    SAFETENSORS_DTYPES,
    TORCH_TO_SAFETENSORS,
    FileHeader,
    TensorEntry,
    dtype_itemsize,
    load_sharded,
    read_header,
)
from convert.io.locate import CONFIG_NAME, RAW_CHUNK, locate, read_config

# Importers of `convert.io.reader` find the header names here too.
__all__ = [
    "SAFETENSORS_DTYPES",
    "TORCH_TO_SAFETENSORS",
    "Checkpoint",
    "FileHeader",
    "TensorEntry",
    "dtype_itemsize",
    "open_checkpoint",
    "read_header",
]


class Checkpoint:
    """A validated, lazily-read safetensors checkpoint.

    Use :func:`open_checkpoint` to create one. Tensors are read one at a
    time; one ``safe_open`` handle is kept per file, opened on first use.
    """

    def __init__(self, path: Path) -> None:
        self.path: Path = Path(path)
        root, files, index_path = locate(self.path)
        self.root: Path = root
        if index_path is not None:
            headers, self._entries = load_sharded(root, index_path)
        else:
            headers = [read_header(f) for f in files]
            self._entries = {n: e for h in headers for n, e in h.tensors.items()}
        self.files: list[Path] = [h.path for h in headers]
        self.metadata: dict[str, str] = dict(headers[0].metadata) if headers else {}
        self.config: dict[str, Any] | None = read_config(root / CONFIG_NAME)
        # What the values are, when not the stored ones (`GGUFCheckpoint`: "GGUF Q4_K_M …, dequantized")
        self.description: str | None = None
        self.quantization: str | None = None
        self._handles: dict[Path, Any] = {}
        self._raw: dict[Path, BinaryIO] = {}
        self._opening = threading.Lock()  # layers are read from two threads: one handle per file

    # -- introspection
    def keys(self) -> list[str]:
        """Tensor names, in file order (files in order, then by data offset)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> TensorEntry:
        """The location record of ``name``; ConvertError if absent."""
        try:
            return self._entries[name]
        except KeyError:
            raise ConvertError(
                f"tensor '{name}' not found in checkpoint {self.path} "
                f"({len(self._entries)} tensors); check the model architecture or the checkpoint"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` as recorded in the header."""
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """torch dtype of ``name``."""
        return self.entry(name).dtype

    def nbytes(self, name: str) -> int:
        """Size in bytes of ``name``'s data."""
        return self.entry(name).nbytes

    def total_bytes(self) -> int:
        """Sum of the data sizes of all tensors."""
        return sum(e.nbytes for e in self._entries.values())

    # -- reading
    def _handle(self, file: Path) -> Any:
        with self._opening:
            handle = self._handles.get(file)
            if handle is None:
                handle = self._handles[file] = safe_open(str(file), framework="pt")
            return handle

    def get(self, name: str) -> torch.Tensor:
        """``name`` as a view of its file's private (copy-on-write) mapping, as transformers'
        ``from_pretrained`` loads on the CPU: nothing is copied, its pages are read at first use and
        stay this process's while the tensor lives, after ``close`` too (a loaded model's weights;
        streaming wants `read`). Writing to it changes this process's copy only."""
        entry = self.entry(name)
        return self._handle(entry.file).get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into its own memory with plain file reads, not through a mapping:
        its pages leave this process's RSS when the tensor is freed (verification streams
        a model through memory this way; `get`'s mapped pages stay resident while open)."""
        entry = self.entry(name)
        return self._from_bytes(entry, self._pread(name, entry, entry.start, entry.nbytes), entry.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the first dimension of ``name``, read like `read`."""
        entry = self.entry(name)
        stop = min(stop, entry.shape[0])
        row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        data = self._pread(name, entry, entry.start + row * start, row * (stop - start))
        return self._from_bytes(entry, data, (stop - start, *entry.shape[1:]))

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Read one tensor into `target` (a contiguous tensor of its shape, any dtype and device)
        with plain file reads: straight into its memory when it is a CPU tensor of the stored
        dtype, else `RAW_CHUNK` bytes at a time, converted as copied. Either way no second copy of
        the tensor is made (filling a whole model: the model is the peak, not model + embedding)."""
        entry = self.entry(name)
        if tuple(target.shape) != tuple(entry.shape) or not target.is_contiguous():
            raise ValueError(f"{name}: cannot read {tuple(entry.shape)} into a {tuple(target.shape)} tensor")
        flat = target.detach().view(-1)  # (numel,)
        if flat.numel() == 0:
            return
        if target.dtype == entry.dtype and target.device.type == "cpu":
            array = flat.view(torch.uint8).numpy()
            view = memoryview(array)  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ is 3.12+ only
            self._pread_into(name, entry, entry.start, view)
            return
        item = entry.nbytes // flat.numel()
        step = max(1, RAW_CHUNK // item)
        for start in range(0, flat.numel(), step):
            n = min(step, flat.numel() - start)
            data = self._pread(name, entry, entry.start + start * item, n * item)
            flat[start : start + n].copy_(torch.frombuffer(data, dtype=entry.dtype))

    def _pread(self, name: str, entry: TensorEntry, offset: int, nbytes: int) -> bytearray:
        """`nbytes` at `offset` of the tensor's file, read straight into one new buffer."""
        buffer = bytearray(nbytes)
        self._pread_into(name, entry, offset, memoryview(buffer))
        return buffer

    def _pread_into(self, name: str, entry: TensorEntry, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` from `offset` of the tensor's file."""
        done, fd, nbytes = 0, self._raw_file(entry.file).fileno(), len(buffer)
        while done < nbytes:
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got == 0:
                raise ConvertError(
                    f"{entry.file}: tensor '{name}' data ends early (file shrank while open?); "
                    "re-download or re-export the checkpoint"
                )
            done += got

    @staticmethod
    def _from_bytes(entry: TensorEntry, data: bytearray, shape: tuple[int, ...]) -> torch.Tensor:
        if not data:
            return torch.empty(shape, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=entry.dtype).reshape(shape)

    def _raw_file(self, file: Path) -> BinaryIO:
        # Under a lock: two threads opening the same file would each keep a handle, and the one
        # dropped from the dict would close its descriptor under the other's read.
        with self._opening:
            f = self._raw.get(file)
            if f is None:
                f = self._raw[file] = open(file, "rb")
            return f

    def raw_bytes(self, name: str) -> bytes:
        """The tensor's exact bytes as stored in the file (for bit-for-bit copies)."""
        return b"".join(self.raw_chunks(name, self.entry(name).nbytes or 1))

    def raw_span(self, name: str) -> tuple[Path, int, int]:
        """(file, offset, nbytes) of the tensor's stored bytes: what a byte-for-byte copy reads
        (never None here: every tensor of a file has its bytes)."""
        entry = self.entry(name)
        return entry.file, entry.start, entry.nbytes

    def raw_chunks(self, name: str, size: int = RAW_CHUNK):
        """The tensor's exact bytes as stored, `size` bytes at a time (a large embedding is
        compared without ever being in memory whole)."""
        entry = self.entry(name)
        for start in range(entry.start, entry.stop, size):
            yield self._pread(name, entry, start, min(size, entry.stop - start))

    # -- lifetime
    def close(self) -> None:
        """Release all open file handles."""
        for handle in self._handles.values():
            # safe_open handles release their mmap on __exit__.
            handle.__exit__(None, None, None)
        self._handles.clear()
        for f in self._raw.values():
            f.close()
        self._raw.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        n_tensors, n_files = len(self._entries), len(self.files)
        return f"Checkpoint({str(self.path)!r}, {n_tensors} tensors, {n_files} files)"


def open_checkpoint(path: str | Path) -> Checkpoint | GGUFCheckpoint:
    """Open and validate a checkpoint.

    ``path`` may be a ``.safetensors`` file, a directory with
    ``model.safetensors.index.json`` (sharded), or a directory with a single
    ``model.safetensors`` (or exactly one ``*.safetensors``). ``config.json``
    next to the weights is parsed when present. A GGUF file (or a directory
    whose only weights are one) opens as a `GGUFCheckpoint`, its config the one
    its metadata describes. Raises ConvertError with a one-line message for
    every kind of bad input.
    """
    root, _, _ = locate(Path(path))
    return GGUFCheckpoint(root) if is_gguf(root) else Checkpoint(Path(path))


def model_files(path: str | Path) -> dict[str, bytes]:
    """Files of a model directory that the checkpoint at `path` carries inside it, by name: a GGUF's
    tokenizer (tokenizer.json, tokenizer_config.json, …); none for safetensors, whose directory has them."""
    root, _, _ = locate(Path(path))
    return tokenizer_files(root) if is_gguf(root) else {}
