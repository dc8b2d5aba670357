"""Safetensors headers, parsed and checked without reading tensor data: dtypes, byte ranges, shard indexes.

A bad header fails here with a one-line `ConvertError` naming the file and the fix, before any tensor is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convert.errors import ConvertError
from convert.io.locate import CONVERT_HINT, MAX_HEADER_DEPTH, check_prelude, parse_json, read_index, short


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
        raise ConvertError.unreadable(path, exc) from None
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


def load_sharded(root: Path, index_path: Path) -> tuple[list[FileHeader], dict[str, TensorEntry]]:
    """Every shard's header, and each tensor's entry as the index places it (shards it names must
    exist and hold what it lists; what a shard holds beyond that is ignored)."""
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
