"""Locating a checkpoint's files and reading its JSON, without torch: the checks of a source that
the command line makes before it imports torch (a missing path, a directory without weights, a
file that is not safetensors or GGUF, a config.json that does not parse), and that `convert.io.reader`
makes again with the rest. A GGUF file is its own model directory: `locate` gives the file as the
root, and `read_config(root / "config.json")` the config its header describes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from convert.errors import ConvertError
from convert.io.gguf_header import checked_gguf, gguf_config, is_gguf

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors' own loader refuses headers above 100 MB; anything larger is
# certainly not a header we should try to parse.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A header nests three levels (header -> tensor entry -> shape list); config.json
# and the shard index a few more. Deeper JSON is refused before Python's
# recursion limit is anywhere near.
MAX_HEADER_DEPTH = 3
RAW_CHUNK = 64 * 1024 * 1024  # bytes per read when copying or comparing stored tensors
MAX_JSON_DEPTH = 32

NOT_SAFETENSORS_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack"}
CONVERT_HINT = "convert it to safetensors first, e.g. with `transformers`' save_pretrained(safe_serialization=True)"

# ---------------------------------------------------------------- strict JSON


class _Refused(ValueError):
    """Raised by the parse hooks: the JSON is well formed but not acceptable."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a JSON object, refusing a key given twice (json keeps the last silently)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Refused(f"key {key[:80]!r} appears twice")
        obj[key] = value
    return obj


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not JSON")


def _nesting_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH, allow_constants: bool = True) -> Any:
    """Parse UTF-8 JSON strictly: no duplicate keys, nesting at most `max_depth` deep
    (NaN/Infinity refused unless `allow_constants`). Raises ValueError saying why."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 at byte {exc.start}") from None
    hooks: dict[str, Any] = {"object_pairs_hook": _unique_keys}
    if not allow_constants:
        hooks["parse_constant"] = _no_constants
    try:
        value = json.loads(text, **hooks)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"JSON does not parse: {exc}") from None
    except _Refused:
        raise
    except ValueError:  # Python refuses to read integers of more than 4300 digits
        raise ValueError("a number has thousands of digits") from None
    if _nesting_depth(value) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    try:  # a \\udXXX escape without its pair decodes to a string no file or terminal can hold
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds an unpaired UTF-16 surrogate escape") from None
    return value


def short(value: Any, limit: int = 60) -> str:
    """repr of a value from a file, cut short: a damaged field may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- the start of a safetensors file


def check_prelude(path: Path) -> tuple[int, int]:
    """(file size, header length) of a safetensors file, from its first 8 bytes and the first byte
    of its header; ConvertError when it cannot be one (too short, a length beyond the file, no JSON).
    A GGUF file's whole header is checked (`convert.io.gguf_header`): (file size, where its data starts)."""
    if is_gguf(path):
        return path.stat().st_size, checked_gguf(path)[0].data_start
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as exc:
        raise ConvertError.unreadable(path, exc) from None
    with f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise ConvertError(
                f"{path}: not a safetensors file (only {size} bytes, too short for a header); {CONVERT_HINT}"
            )
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
            raise ConvertError(
                f"{path}: not a safetensors file or truncated (header length field says "
                f"{header_len} bytes, file has {size}); re-download the file, or {CONVERT_HINT}"
            )
        if not f.read(min(header_len, 64)).lstrip().startswith(b"{"):
            raise ConvertError(f"{path}: not a safetensors file (no JSON header); {CONVERT_HINT}")
    return size, header_len


# ---------------------------------------------------------------- locating files


def read_json(path: Path, what: str, fix: str) -> Any:
    """A JSON file parsed strictly (`parse_json`); ConvertError naming the file and `fix` otherwise."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConvertError.unreadable(path, exc, what) from None
    try:
        return parse_json(data)
    except ValueError as exc:
        raise ConvertError(f"{path}: {what} is not valid JSON ({exc}); {fix}") from None


def read_config(path: Path) -> dict[str, Any] | None:
    """config.json parsed (None when absent); `<file.gguf>/config.json`, the GGUF's (`locate`)."""
    if path.name == CONFIG_NAME and is_gguf(path.parent):
        return gguf_config(path.parent)
    if not path.is_file():
        return None
    config = read_json(path, "config", "fix or re-download config.json")
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: config is not a JSON object; fix or re-download config.json")
    return config


def read_index(index_path: Path) -> dict[str, str]:
    fix = "fix or re-download model.safetensors.index.json"
    index = read_json(index_path, "index", fix)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ConvertError(f"{index_path}: index has no valid 'weight_map' (tensor name -> shard file); {fix}")
    for name, shard in weight_map.items():
        if not _is_plain_file_name(shard):
            raise ConvertError(
                f"{index_path}: tensor {short(name)} is mapped to {short(shard)}, not a file name in the "
                f"checkpoint's directory; {fix}"
            )
    return weight_map


def _is_plain_file_name(name: str) -> bool:
    """A shard named by the index must be a file beside it: no directories, no '..'."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def locate(path: Path) -> tuple[Path, list[Path], Path | None]:
    """Return (root, safetensors files, index path or None) for a user path; for a GGUF file (or a
    directory whose only weights are one), (the file, [the file], None)."""
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory; check the checkpoint path")
    if path.is_dir():
        return locate_in_dir(path)
    if is_gguf(path):
        return path, [path], None
    if path.name == INDEX_NAME:
        return path.parent, [], path
    if path.suffix.lower() in NOT_SAFETENSORS_SUFFIXES:
        raise ConvertError(f"{path}: not a safetensors file; {CONVERT_HINT}")
    return path.parent, [path], None


def locate_in_dir(path: Path) -> tuple[Path, list[Path], Path | None]:
    if (path / INDEX_NAME).is_file():
        return path, [], path / INDEX_NAME
    if (path / SINGLE_NAME).is_file():
        return path, [path / SINGLE_NAME], None
    found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if len(found) == 1:
        return path, found, None
    if len(found) > 1:
        raise ConvertError(
            f"{path}: directory holds {len(found)} .safetensors files but no {INDEX_NAME}; "
            "point at one file or add an index"
        )
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ggufs[0], ggufs, None
    if ggufs:
        raise ConvertError(f"{path}: directory holds {len(ggufs)} .gguf files and no safetensors; point at one file")
    others = sorted(p.name for p in path.iterdir() if p.suffix.lower() in NOT_SAFETENSORS_SUFFIXES)
    if others:
        raise ConvertError(f"{path}: no .safetensors files (found {others[0]}); {CONVERT_HINT}")
    raise ConvertError(f"{path}: directory holds no .safetensors files; check the checkpoint path")
