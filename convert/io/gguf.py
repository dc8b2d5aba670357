"""A GGUF file (llama.cpp's format) read as a checkpoint: `GGUFCheckpoint`, a `TensorSource` in transformers'
names and layouts, whose config is the config.json its metadata describes and whose tokenizer transformers
builds from it (`gguf_tokenizer`, `tokenizer_files`).

The header is checked first (`convert.io.gguf_header`); tensors are then read one at a time with plain file
reads, a quantized one dequantized by the `gguf` package (llama.cpp's own) a few rows at a time, so memory
holds one tensor, as a safetensors source of the same size would.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer

from convert.errors import ConvertError
from convert.io.gguf_header import (
    FLOAT_TYPES,
    HFTensor,
    TensorInfo,
    hf_config,
    hf_tensors,
    read_gguf_header,
)
from convert.io.locate import RAW_CHUNK

#: bytes of float32 output a quantized tensor is dequantized in at a time (the dequantizer's own
#: temporaries are a few times this)
DEQUANT_CHUNK = 16 * 1024 * 1024


class GGUFCheckpoint:
    """A GGUF file as a `convert.io.tensor_source.TensorSource`, with `Checkpoint`'s extras (`get`,
    `read_into`, `raw_chunks`, `total_bytes`, `config`, `path`, `root`, `files`, `close`).

    Tensors have transformers' names and layouts: Llama's q/k rows are put back in transformers' order
    (llama.cpp permutes them for its interleaved RoPE), Gemma's norms stored as 1 + w become w. dtype:
    the stored float type for F32, F16 and BF16 tensors (bytes as stored); float32 for a quantized tensor
    (dequantized) and for a norm stored as 1 + w. `root` is the file itself: it holds what a model
    directory would (config.json, the tokenizer: `convert.text.model_tokenizer` reads it there).
    `description` says what the values are, for the verification report (e.g. "GGUF Q4_K_M,
    dequantized to float32"); `quantization` is the file's type name when any tensor is quantized.
    """

    def __init__(self, path: Path) -> None:
        self.path: Path = Path(path)
        self.root: Path = self.path
        self.files: list[Path] = [self.path]
        self.metadata: dict[str, str] = {}
        self.header = read_gguf_header(self.path)
        self.config: dict[str, Any] = hf_config(self.header)
        self._tensors: dict[str, HFTensor] = hf_tensors(self.header, self.config)
        self.quantization: str | None = _quantization(self.header)
        self.description: str = _description(self.header, self.quantization)
        self._file: BinaryIO | None = None
        self._opening = threading.Lock()

    # -- introspection
    def keys(self) -> list[str]:
        """Tensor names (transformers'), in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def _tensor(self, name: str) -> HFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise ConvertError(
                f"tensor '{name}' not found in checkpoint {self.path} ({len(self._tensors)} tensors); "
                "check the model architecture or the checkpoint"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name).info.shape

    def dtype(self, name: str) -> torch.dtype:
        """The stored float type, or float32 where the values are computed (dequantized, 1 + w undone)."""
        return _dtype(self._tensor(name))

    def nbytes(self, name: str) -> int:
        """Bytes of `name` as read (dequantized), not as stored."""
        return _numel(self.shape(name)) * self.dtype(name).itemsize

    def total_bytes(self) -> int:
        """Bytes of every tensor as read (a quantized model counts dequantized: what memory holds)."""
        return sum(self.nbytes(name) for name in self._tensors)

    # -- reading
    def read(self, name: str) -> torch.Tensor:
        """One tensor in memory of its own (plain file reads, no mapping), dequantized a few rows at a time."""
        tensor = self._tensor(name)
        if tensor.heads is not None or tensor.minus_one:
            return self._transformed(tensor)
        out = torch.empty(tensor.info.shape, dtype=_dtype(tensor))
        for start, stop, values in self._pieces(tensor.info, 0, _rows(tensor.info)):
            out[start:stop] = values
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of the first dimension (clamped), reading only their bytes where the rows
        are stored whole (an embedding's rows: the calibration reads one per token)."""
        tensor = self._tensor(name)
        rows = _rows(tensor.info)
        if tensor.heads is not None or tensor.minus_one or len(tensor.info.shape) == 1:
            return self.read(name)[start:stop]
        start, stop = min(max(start, 0), rows), min(max(stop, 0), rows)
        stop = max(start, stop)
        out = torch.empty((stop - start, *tensor.info.shape[1:]), dtype=_dtype(tensor))
        for a, b, values in self._pieces(tensor.info, start, stop):
            out[a - start : b - start] = values
        return out

    def get(self, name: str) -> torch.Tensor:
        """`read`: a GGUF tensor is never a view of the file (most are dequantized)."""
        return self.read(name)

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Read one tensor into `target` (a contiguous tensor of its shape, any dtype and device), a
        piece at a time: no second whole copy of a large (dequantized) tensor is made."""
        tensor = self._tensor(name)
        if tuple(target.shape) != tensor.info.shape or not target.is_contiguous():
            raise ValueError(f"{name}: cannot read {tensor.info.shape} into a {tuple(target.shape)} tensor")
        with torch.no_grad():
            if tensor.heads is not None or tensor.minus_one:
                target.copy_(self._transformed(tensor))
                return
            for start, stop, values in self._pieces(tensor.info, 0, _rows(tensor.info)):
                target[start:stop].copy_(values)

    def raw_span(self, name: str) -> tuple[Path, int, int] | None:
        """(file, offset, nbytes) where the file stores the tensor as read (an F32/F16/BF16 tensor in
        transformers' layout); None where it is computed (dequantized, permuted, 1 + w undone)."""
        tensor = self._tensor(name)
        if tensor.info.type_id not in FLOAT_TYPES or tensor.heads is not None or tensor.minus_one:
            return None
        return self.path, tensor.info.start, tensor.info.nbytes

    def raw_chunks(self, name: str, size: int = RAW_CHUNK):
        """The tensor's bytes as read (C order, little-endian), in pieces of about `size` bytes."""
        tensor = self._tensor(name)
        span = self.raw_span(name)
        if span is not None:
            _, start, nbytes = span
            for offset in range(start, start + nbytes, size):
                yield self._pread(offset, min(size, start + nbytes - offset))
        elif tensor.heads is not None or tensor.minus_one:
            yield _bytes(self._transformed(tensor))
        else:
            for _, _, values in self._pieces(tensor.info, 0, _rows(tensor.info)):
                yield _bytes(values)

    def raw_bytes(self, name: str) -> bytes:
        """The tensor's bytes as read, in one piece."""
        return b"".join(self.raw_chunks(name))

    def _transformed(self, tensor: HFTensor) -> torch.Tensor:
        """A tensor llama.cpp stored transformed, in transformers' form: q/k rows back from llama.cpp's
        `permute` (per head, the two halves of the rotary pairs interleaved), a norm's 1 + w back to w."""
        values = torch.empty(tensor.info.shape, dtype=_dtype(tensor))
        for start, stop, piece in self._pieces(tensor.info, 0, _rows(tensor.info)):
            values[start:stop] = piece
        if tensor.heads is not None:
            shape = values.shape
            values = values.reshape(tensor.heads, shape[0] // tensor.heads // 2, 2, *shape[1:])
            values = values.transpose(1, 2).reshape(shape).contiguous()  # (heads, d/2, 2) -> (heads, 2, d/2)
        if tensor.minus_one:
            values = values.float() - 1.0
        return values

    def _pieces(self, info: TensorInfo, start: int, stop: int):
        """(first row, end row, values) for rows start:stop of the stored tensor, a piece at a time:
        a float type as stored, a quantized one dequantized to float32. A vector is one piece (a
        quantized one has no whole rows)."""
        if len(info.shape) == 1:
            yield 0, info.shape[0], self._values(info, self._pread(info.start, info.nbytes), info.shape)
            return
        row_values = _numel(info.shape[1:])
        row_bytes = info.nbytes // info.shape[0]
        if info.type_id in FLOAT_TYPES:
            step = max(1, RAW_CHUNK // max(row_bytes, 1))
        else:
            step = max(1, DEQUANT_CHUNK // (4 * row_values))
        for first in range(start, stop, step):
            last = min(first + step, stop)
            data = self._pread(info.start + first * row_bytes, (last - first) * row_bytes)
            yield first, last, self._values(info, data, (last - first, *info.shape[1:]))

    @staticmethod
    def _values(info: TensorInfo, data: bytearray, shape: tuple[int, ...]) -> torch.Tensor:
        if info.type_id in FLOAT_TYPES:
            return torch.frombuffer(data, dtype=getattr(torch, FLOAT_TYPES[info.type_id])).reshape(shape)
        rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, info.nbytes // (_numel(info.shape) // info.dims[0]))
        with np.errstate(all="ignore"):  # a damaged block's scale may be inf/NaN: the values say so, not a warning
            values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(info.type_id))  # (rows, dims[0])
        return torch.from_numpy(values).reshape(shape)

    def _pread(self, offset: int, nbytes: int) -> bytearray:
        """`nbytes` at `offset` of the file, read straight into one new buffer."""
        buffer = bytearray(nbytes)
        view, done, fd = memoryview(buffer), 0, self._fd()
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ConvertError(
                    f"{self.path}: tensor data ends early (file shrank while open?); re-download the file"
                )
            done += got
        return buffer

    def _fd(self) -> int:
        with self._opening:  # layers are read from two threads: one descriptor
            if self._file is None:
                self._file = open(self.path, "rb")
            return self._file.fileno()

    # -- lifetime
    def close(self) -> None:
        """Release the open file."""
        with self._opening:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {len(self._tensors)} tensors, {self.description})"


def _dtype(tensor: HFTensor) -> torch.dtype:
    stored = FLOAT_TYPES.get(tensor.info.type_id)
    return getattr(torch, stored) if stored and not tensor.minus_one else torch.float32


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rows(info: TensorInfo) -> int:
    return info.shape[0]


def _bytes(values: torch.Tensor) -> memoryview:
    array = values.contiguous().view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ is 3.12+ only


def _quantization(header) -> str | None:
    """The file's type as llama.cpp names it (Q4_K_M: `general.file_type`), when any tensor is quantized."""
    if all(t.type_id in FLOAT_TYPES for t in header.tensors.values()):
        return None
    file_type = header.metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except (ValueError, TypeError):
        return "quantized"


def _description(header, quantization: str | None) -> str:
    """What the values read are: e.g. "GGUF Q4_K_M (Q4_K 169, F32 141, Q6_K 29 tensors), dequantized to float32"."""
    counts = Counter(t.type_name for t in header.tensors.values())
    types = ", ".join(f"{name} {n}" for name, n in counts.most_common())
    if quantization is None:
        return f"GGUF ({types} tensors), read as stored"
    return f"GGUF {quantization} ({types} tensors), dequantized to float32"


# ------------------------------------------------------------------ the tokenizer it carries


@lru_cache(maxsize=2)
def _tokenizer(path: Path, metadata_digest: str):
    with tempfile.TemporaryDirectory(prefix="convert-gguf-") as alone:  # no stray tokenizer files beside it
        (Path(alone) / "model.gguf").symlink_to(path)
        try:
            return AutoTokenizer.from_pretrained(alone, gguf_file="model.gguf")
        except Exception as exc:  # noqa: BLE001 - whatever transformers' GGUF reader raises, one line
            why = " ".join(str(exc).split())[:160]
            raise ConvertError(
                f"{path}: transformers cannot build its tokenizer ({type(exc).__name__}: {why}); "
                "convert the model's safetensors"
            ) from None


def gguf_tokenizer(path: Path | str):
    """The tokenizer a GGUF file carries, as transformers builds it (`AutoTokenizer.from_pretrained(dir,
    gguf_file=...)`: ~20 s for a 150,000-token vocabulary), built once per file content; None when the
    file has none. Shared: do not modify it."""
    header = read_gguf_header(path)  # checked before transformers' own reader sees the file
    if "tokenizer.ggml.model" not in header.metadata:
        return None
    with open(header.path, "rb") as f:
        digest = hashlib.sha256(f.read(header.data_start)).hexdigest()  # the metadata, tokenizer included
    return _tokenizer(Path(path).resolve(), digest)


def tokenizer_files(path: Path | str) -> dict[str, bytes]:
    """The files a model directory holds for the tokenizer a GGUF carries (tokenizer.json,
    tokenizer_config.json, chat_template.jinja …): what a conversion writes beside its weights."""
    tokenizer = gguf_tokenizer(path)
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="convert-gguf-") as out:
        tokenizer.save_pretrained(out)
        return {f.name: f.read_bytes() for f in sorted(Path(out).iterdir()) if f.is_file()}
