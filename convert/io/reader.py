"""Open a safetensors checkpoint (single file, sharded directory or HF model dir), validated at open time.

Every file's header is parsed and checked first, so a bad checkpoint fails fast with a one-line `ConvertError` instead
of a stack trace halfway through a conversion; tensor data is read later, one tensor at a time, on demand.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from convert.errors import ConvertError
from convert.io.locate import (
    CONFIG_NAME,
    CONVERT_HINT,
    MAX_HEADER_DEPTH,
    RAW_CHUNK,
    check_prelude,
    locate,
    parse_json,
    read_config,
    read_index,
    short,
)


def _build_dtype_table() -> dict[str, torch.dtype]:
    table = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    # F8 types only exist in newer torch builds; map them when available.
    for code, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[code] = getattr(torch, attr)
    return table


#: safetensors dtype code -> torch dtype.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = _build_dtype_table()
#: torch dtype -> safetensors dtype code.
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file (header included)
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class FileHeader:
    """A parsed safetensors header: its tensors (in data order) and metadata."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


# ---------------------------------------------------------------- header parsing


def read_header(path: Path) -> FileHeader:
    """Parse and validate the header of one safetensors file without reading data.

    The header is parsed strictly (`parse_json`: valid UTF-8, no key given twice, bounded nesting), as
    config.json and the shard index are; its entries must have a known dtype, a shape of non-negative
    integers and offsets that tile the data area exactly, as safetensors requires.
    """
    size, header_len = check_prelude(path)
    try:
        with open(path, "rb") as f:
            f.seek(8)
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read ({exc.strerror}); check the path and permissions") from None
    data_start = 8 + header_len
    header = _parse_header_json(path, header_bytes)
    metadata = _parse_metadata(path, header.pop("__metadata__", None))
    tensors = {name: _parse_entry(path, name, spec, data_start) for name, spec in header.items()}
    _check_data_fits(path, tensors, size, data_start)
    ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].stop)))
    return FileHeader(path=path, tensors=ordered, metadata=metadata)


def _parse_header_json(path: Path, header_bytes: bytes) -> dict[str, Any]:
    # A file that does not even start with '{' is some other format, not a
    # damaged safetensors file; say so, because the fix is different.
    if not header_bytes.lstrip().startswith(b"{"):
        raise ConvertError(f"{path}: not a safetensors file (no JSON header); {CONVERT_HINT}")
    try:
        # safetensors' own parser refuses NaN/Infinity; so do we.
        header = parse_json(header_bytes, MAX_HEADER_DEPTH, allow_constants=False)
    except ValueError as exc:
        raise ConvertError(
            f"{path}: corrupt safetensors header ({exc}); re-download or re-export the checkpoint"
        ) from None
    if not isinstance(header, dict):
        raise ConvertError(
            f"{path}: corrupt safetensors header (JSON is not an object); re-download or re-export the checkpoint"
        )
    return header


def _parse_metadata(path: Path, meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ConvertError(
            f"{path}: corrupt safetensors header (__metadata__ must map strings to strings); "
            "re-download or re-export the checkpoint"
        )
    return dict(meta)


def _corrupt(path: Path, name: str, why: str) -> ConvertError:
    return ConvertError(
        f"{path}: corrupt safetensors header, tensor {short(name, 200)} {why}; re-download or re-export the checkpoint"
    )


def _parse_entry(path: Path, name: str, spec: Any, data_start: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _corrupt(path, name, "is not a JSON object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in spec:
            raise _corrupt(path, name, f"lacks '{field}'")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str):
        raise _corrupt(path, name, f'has dtype {short(code)}, not a dtype name such as "F32"')
    if code not in SAFETENSORS_DTYPES:
        raise ConvertError(
            f"{path}: tensor {short(name, 200)} has unsupported dtype {short(code)} "
            f"(supported: {', '.join(SAFETENSORS_DTYPES)}); re-export the checkpoint in "
            "one of these dtypes"
        )
    if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
        raise _corrupt(path, name, f"has invalid shape {short(shape)} (a list of non-negative integers)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_nonneg_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _corrupt(path, name, f"has invalid data_offsets {short(offsets)} (a pair [begin, end], begin <= end)")
    dtype = SAFETENSORS_DTYPES[code]
    expected = math.prod(shape) * dtype_itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise _corrupt(
            path,
            name,
            f"has data_offsets {offsets} spanning {offsets[1] - offsets[0]} bytes but shape "
            f"{shape} x {code} needs {expected}",
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_nonneg_int(x: Any) -> bool:
    # bool is an int subclass in Python; a shape of [true] is still corrupt.
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_data_fits(path: Path, tensors: dict[str, TensorEntry], size: int, data_start: int) -> None:
    declared = max((e.stop for e in tensors.values()), default=data_start) - data_start
    available = size - data_start
    if declared > available:
        raise ConvertError(
            f"{path}: file is truncated (header declares {declared} bytes of data, file has "
            f"{available}); re-download or re-export the checkpoint"
        )
    # safetensors itself refuses files whose data has holes, overlaps or
    # trailing bytes; catch that here rather than at the first read.
    cursor = data_start
    for name, entry in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].stop)):
        if entry.start != cursor:
            raise _corrupt(path, name, "has data_offsets that overlap or leave a gap")
        cursor = entry.stop
    if declared < available:
        raise ConvertError(
            f"{path}: corrupt safetensors file ({available - declared} bytes after the last "
            "tensor's data); re-download or re-export the checkpoint"
        )


def _load_sharded(root: Path, index_path: Path) -> tuple[list[FileHeader], dict[str, TensorEntry]]:
    weight_map = read_index(index_path)
    shard_names = sorted(set(weight_map.values()))
    headers: dict[str, FileHeader] = {}
    for shard in shard_names:
        shard_path = root / shard
        if not shard_path.is_file():
            raise ConvertError(
                f"{index_path}: references shard {short(shard, 200)} which does not exist in {root}; "
                "re-download the missing shard"
            )
        headers[shard] = read_header(shard_path)
    entries: dict[str, TensorEntry] = {}
    for header in headers.values():
        for name, entry in header.tensors.items():
            # The index is authoritative (it is what transformers loads);
            # tensors a shard holds but the index does not list are ignored.
            if weight_map.get(name) == header.path.name:
                entries[name] = entry
    for name, shard in weight_map.items():
        if name not in entries:
            raise ConvertError(
                f"{index_path}: lists tensor {short(name, 200)} in {short(shard, 200)} but that shard has no such "
                "tensor; re-download the checkpoint or fix the index"
            )
    return list(headers.values()), entries


# ---------------------------------------------------------------- Checkpoint


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
            headers, self._entries = _load_sharded(root, index_path)
        else:
            headers = [read_header(f) for f in files]
            self._entries = {n: e for h in headers for n, e in h.tensors.items()}
        self.files: list[Path] = [h.path for h in headers]
        self.metadata: dict[str, str] = dict(headers[0].metadata) if headers else {}
        self.config: dict[str, Any] | None = read_config(root / CONFIG_NAME)
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
        """Read one tensor (only its bytes) from disk."""
        entry = self.entry(name)
        return self._handle(entry.file).get_tensor(name)

    def mapped(self, name: str) -> torch.Tensor:
        """``name`` as a view of its file's private (copy-on-write) mapping, as transformers'
        ``from_pretrained`` loads on the CPU: nothing is copied, its pages are read at first use and
        stay this process's while the tensor lives, after ``close`` too (a loaded model's weights;
        streaming wants `read`). Writing to it changes this process's copy only."""
        return self.get(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Read rows ``start:stop`` of the first dimension of ``name``."""
        entry = self.entry(name)
        return self._handle(entry.file).get_slice(name)[start:stop]

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
            self._pread_into(name, entry, entry.start, memoryview(flat.view(torch.uint8).numpy()))
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
        """(file, offset, nbytes) of the tensor's stored bytes: what a byte-for-byte copy reads."""
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


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open and validate a checkpoint.

    ``path`` may be a ``.safetensors`` file, a directory with
    ``model.safetensors.index.json`` (sharded), or a directory with a single
    ``model.safetensors`` (or exactly one ``*.safetensors``). ``config.json``
    next to the weights is parsed when present. Raises ConvertError with a
    one-line message for every kind of bad input.
    """
    return Checkpoint(Path(path))
