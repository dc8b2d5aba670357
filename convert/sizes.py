"""Byte sizes as people write them (`5GB`, `2GiB`, `800MB`) and as the tool prints them. Light: the
command line parses `--max-shard-size` and `--max-memory` with it before importing torch."""

import re
from decimal import Decimal, InvalidOperation

from convert.errors import ConvertError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """Parse a byte size: ``"5GB"`` -> 5*10**9, ``"2GiB"`` -> 2*2**30, ``"1000"`` -> 1000; `flag`
    names the option in the refusal."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConvertError(f"{flag}: cannot parse {str(text)!r}; use bytes or a unit like 5GB, 500MB, 2GiB")
    try:
        size = int(Decimal(match.group(1)) * _UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        size = 0
    if size <= 0:
        raise ConvertError(f"{flag}: {str(text)!r} is not a positive size; use e.g. 5GB, 500MB, 2GiB")
    return size


def gib(n: float) -> str:
    """Bytes as GiB with two decimals: `1.34 GiB`."""
    return f"{n / 2**30:.2f} GiB"
