"""Fuzzing safetensors headers: a damaged `model.safetensors` header ends in one clean
`error:` line and exit 2 with nothing on disk, an equivalent one converts (tests/fuzzing.py)."""

import copy
import json
import math
import random
import shutil
import struct

import fuzzing
import pytest
from fuzzing import ATTENTION, DATA, HEADER, NAMES, SEED, Case, Tally, dump, pack, run_conversion

from conftest import TINY_LLAMA

N_HEADER = 500  # at least this many cases

one_thread = fuzzing.one_thread  # autouse: the cases run on one torch thread


def _members(header: dict) -> list[bytes]:
    return [json.dumps(k).encode() + b":" + json.dumps(v, separators=(",", ":")).encode() for k, v in header.items()]


def _join(members: list[bytes]) -> bytes:
    return b"{" + b",".join(members) + b"}"


def _with(name: str, field: str, value) -> bytes:
    """The header with one field of one tensor's entry replaced."""
    header = copy.deepcopy(HEADER)
    header[name][field] = value
    return pack(dump(header))


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _h_json_syntax(rng):
    text = dump(HEADER)
    if rng.random() < 0.3:
        cut = rng.randrange(1, len(text) - 1)
        return Case("json-syntax", "refuse", f"header cut at {cut}", pack(text[:cut]))
    positions = [i for i, c in enumerate(text) if chr(c) in '{}[]:,"']
    i = rng.choice(positions)
    return Case("json-syntax", "refuse", f"byte {i} {chr(text[i])!r} deleted", pack(text[:i] + text[i + 1 :]))


def _h_invalid_utf8(rng):
    text = dump(HEADER)
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"])
    name = rng.choice(NAMES).encode()
    i = text.index(b'"' + name + b'"') + 1 + rng.randrange(len(name))
    return Case("invalid-utf8", "refuse", f"{bad!r} in a tensor name", pack(text[:i] + bad + text[i:]))


def _h_not_object(rng):
    text = rng.choice([b"[]", b'"header"', b"42", b"null", b"true", b"[" + dump(HEADER) + b"]"])
    return Case("not-object", "refuse", text[:20].decode(), pack(text))


def _h_deep(rng):
    depth = rng.choice([2, 5, 50, 900, 5000, 200000])
    where = rng.choice(["shape", "extra", "metadata", "top"])
    if where in ("shape", "extra"):
        header = copy.deepcopy(HEADER)
        name = rng.choice(NAMES)
        field = "shape" if where == "shape" else "extra"
        header[name][field] = "@@"
        text = dump(header).replace(b'"@@"', _nested(depth))
    elif where == "metadata":
        text = dump(HEADER).replace(b'{"format":"pt"}', b'{"format":' + _nested(depth) + b"}")
    else:
        text = b'{"deep":' + _nested(depth) + b"," + dump(HEADER)[1:]
    return Case("deep-nesting", "refuse", f"{where} nested {depth}", pack(text))


def _h_duplicate(rng):
    members = _members(HEADER)
    which = rng.choice(["tensor", "metadata", "metadata-other", "field"])
    i = rng.randrange(1, len(members)) if which in ("tensor", "field") else 0
    if which == "tensor":
        members.insert(rng.randrange(len(members) + 1), members[i])
    elif which == "metadata":
        members.append(members[0])
    elif which == "metadata-other":
        members.insert(rng.randrange(1, len(members)), b'"__metadata__":{"format":"np"}')
    else:
        members[i] = members[i].replace(b'{"dtype":"F32"', b'{"dtype":"F32","dtype":"F32"')
    return Case("duplicate-key", "refuse", which, pack(_join(members)))


def _h_dtype_type(rng):
    value = rng.choice([["F32"], 32, None, True, {"F32": 1}, 1.5, [], ""])
    return Case("dtype-type", "refuse", repr(value), _with(rng.choice(NAMES), "dtype", value))


def _h_dtype_unknown(rng):
    value = rng.choice(["F33", "f32", "Q4_0", "float32", "F32 ", "U32", "I4", "F8_E4M3FNUZ"])
    return Case("dtype-unknown", "refuse", value, _with(rng.choice(NAMES), "dtype", value))


def _h_dtype_relabel(rng):
    """Same bytes, another dtype: I32 keeps the shape, F16/BF16 double a dim, F64 halves one."""
    name = rng.choice(NAMES)
    shape = list(HEADER[name]["shape"])
    code = rng.choice(["I32", "I32", "F16", "BF16", "F64", "I16", "U8", "BOOL", "I64"])
    size = {"I32": 4, "F16": 2, "BF16": 2, "F64": 8, "I16": 2, "U8": 1, "BOOL": 1, "I64": 8}[code]
    if size < 4:
        shape[-1] *= 4 // size
    elif size > 4:
        if shape[-1] % 2:
            return _h_dtype_relabel(rng)
        shape[-1] //= 2
    header = copy.deepcopy(HEADER)
    header[name].update(dtype=code, shape=shape)
    return Case("dtype-relabel", "refuse", f"{name} F32->{code} {shape}", pack(dump(header)))


def _h_shape_type(rng):
    name = rng.choice(NAMES)
    dims = HEADER[name]["shape"]
    value = rng.choice(
        [
            "64",
            64,
            None,
            {"0": 64},
            [float(d) for d in dims],
            [True] + dims[1:],
            [str(d) for d in dims],
            [-d for d in dims],
            [dims],
            [2**70, 0],
        ]
    )
    return Case("shape-type", "refuse", f"{name} {value!r}"[:80], _with(name, "shape", value))


def _h_shape_reshape(rng):
    """Same number of elements (the file stays consistent), another shape: the model's differs."""
    name = rng.choice(NAMES)
    dims = list(HEADER[name]["shape"])
    how = rng.choice(["flatten", "permute", "split", "unsqueeze"])
    if how == "flatten":
        new = [math.prod(dims)]
    elif how == "permute":
        new = dims[::-1]
    elif how == "split":
        new = [dims[0] // 2, 2, *dims[1:]] if dims[0] % 2 == 0 else [dims[0], 1, *dims[1:]]
    else:
        new = [1, *dims]
    expect = "either" if new == dims else "refuse"
    return Case("shape-reshape", expect, f"{name} {dims}->{new}", _with(name, "shape", new))


def _h_shape_size(rng):
    name = rng.choice(NAMES)
    dims = list(HEADER[name]["shape"])
    axis = rng.randrange(len(dims))
    dims[axis] += rng.choice([-1, 1, 7])
    return Case("shape-size", "refuse", f"{name} -> {dims}", _with(name, "shape", dims))


def _h_offsets_type(rng):
    name = rng.choice(NAMES)
    begin, end = HEADER[name]["data_offsets"]
    value = rng.choice(
        [
            f"{begin},{end}",
            [begin],
            [begin, end, end],
            [float(begin), float(end)],
            [False, True],
            [-4, end - 4],
            None,
            {"0": begin},
            [end, begin],
            [str(begin), str(end)],
        ]
    )
    if value == [end, begin] and begin == end:
        value = None
    return Case("offsets-type", "refuse", f"{name} {value!r}", _with(name, "data_offsets", value))


def _h_offsets_shift(rng):
    name = rng.choice(NAMES)
    begin, end = HEADER[name]["data_offsets"]
    shift = rng.choice([-8, -4, 4, 8, 1, len(DATA)])
    return Case(
        "offsets-shift", "refuse", f"{name} by {shift}", _with(name, "data_offsets", [begin + shift, end + shift])
    )


def _h_offsets_swap(rng):
    """Two tensors of the same shape exchange their data: a valid file, another model."""
    by_shape = {}
    for n in NAMES:
        by_shape.setdefault(tuple(HEADER[n]["shape"]), []).append(n)
    a, b = rng.sample(rng.choice([names for names in by_shape.values() if len(names) > 1]), 2)
    header = copy.deepcopy(HEADER)
    header[a]["data_offsets"], header[b]["data_offsets"] = HEADER[b]["data_offsets"], HEADER[a]["data_offsets"]
    return Case("offsets-swap", "either", f"{a} <-> {b}", pack(dump(header)))


def _h_metadata(rng):
    value = rng.choice([[], "pt", 3, {"format": 3}, {"format": None}, {"format": ["pt"]}, {"a": {"b": "c"}}, True])
    header = dict(HEADER)
    header["__metadata__"] = value
    return Case("metadata-type", "refuse", repr(value), pack(dump(header)))


def _h_rename(rng):
    name = rng.choice(NAMES)
    other = rng.choice([n for n in NAMES if n != name])
    new = rng.choice(
        [
            name + "x",
            name.upper(),
            "",
            name.replace("layers.1.", "layers.2.").replace("layers.0.", "layers.5."),
            name.replace(".weight", ".bias"),
            "model.layers.99999999999999.mlp.up_proj.weight",
            other,  # a duplicate: two entries with one name
        ]
    )
    if new == name:
        new = name + "x"
    members = _members(HEADER)
    i = NAMES.index(name) + 1
    members[i] = json.dumps(new).encode() + members[i][len(json.dumps(name)) :]
    return Case("rename", "refuse", f"{name} -> {new!r}", pack(_join(members)))


def _h_drop(rng):
    name = rng.choice(NAMES)
    header = {k: v for k, v in HEADER.items() if k != name}
    return Case("drop-entry", "refuse", name, pack(dump(header)))


def _h_length_field(rng):
    text = dump(HEADER)
    delta = rng.choice([1, 4, 8, -1, -3, 2**40, 2**63, -len(text)])
    length = len(text) + delta
    raw = struct.pack("<Q", length % 2**64) + text + DATA
    return Case("length-field", "refuse", f"header length {delta:+d}", raw)


def _h_file_size(rng):
    raw = pack(dump(HEADER))
    how = rng.choice(["append", "truncate", "empty", "short"])
    if how == "append":
        raw += b"\0" * rng.choice([1, 4, 100])
    elif how == "truncate":
        raw = raw[: -rng.choice([1, 4, 1000, len(DATA)])]
    elif how == "empty":
        raw = b""
    else:
        raw = raw[:5]
    return Case("file-size", "refuse", how, raw)


def _h_bad_numbers(rng):
    name = rng.choice(NAMES)
    header = copy.deepcopy(HEADER)
    header[name]["shape"] = "@@"
    token = rng.choice([b"[NaN,64]", b"[Infinity]", b"[1" + b"0" * 5000 + b"]", b"[-0]", b"[1e2,64]", b"[0x40]"])
    expect = "refuse"
    return Case("bad-numbers", expect, f"{name} shape {token[:20]!r}", pack(dump(header).replace(b'"@@"', token)))


def _h_odd_strings(rng):
    name = rng.choice(NAMES)
    members = _members(HEADER)
    i = NAMES.index(name) + 1
    new = rng.choice([b'"\\ud800' + name.encode() + b'"', b'"\xef\xbb\xbf' + name.encode() + b'"'])
    members[i] = new + members[i][len(json.dumps(name)) :]
    return Case("odd-strings", "refuse", f"{name} as {new[:12]!r}", pack(_join(members)))


def _h_prefix(rng):
    text = rng.choice([b"\xef\xbb\xbf", b"\x00", b"\n\n\n"]) + dump(HEADER)
    expect = "pass" if text.startswith(b"\n") else "refuse"  # leading whitespace is valid JSON
    return Case("prefix", expect, repr(text[:3]), pack(text))


def _h_nan_data(rng):
    """A NaN/Inf inside an attention weight: found while converting, after the output was started."""
    name = rng.choice(ATTENTION)
    begin, end = HEADER[name]["data_offsets"]
    at = begin + 4 * rng.randrange((end - begin) // 4)
    value = struct.pack("<f", rng.choice([float("nan"), float("inf"), float("-inf")]))
    return Case("non-finite", "refuse", f"{name} @{at}", pack(dump(HEADER), DATA[:at] + value + DATA[at + 4 :]))


# --- equivalent headers and self-consistent others


def _h_reorder(rng):
    items = list(HEADER.items())
    rng.shuffle(items)
    header = {k: (dict(sorted(v.items(), key=lambda _: rng.random())) if k != "__metadata__" else v) for k, v in items}
    return Case("reorder", "pass", "entries and fields shuffled", pack(dump(header)))


def _h_whitespace(rng):
    how = rng.choice(["indent", "spaces", "padding", "newlines"])
    if how == "indent":
        text = json.dumps(HEADER, indent=rng.choice([1, 2, 4])).encode()
    elif how == "spaces":
        text = json.dumps(HEADER).encode()
    elif how == "padding":
        text = dump(HEADER) + b" " * rng.randrange(1, 64)
    else:
        text = dump(HEADER).replace(b",", b",\n")
    return Case("whitespace", "pass", how, pack(text))


def _h_escapes(rng):
    name = rng.choice(NAMES)
    escaped = "".join(f"\\u{ord(c):04x}" if rng.random() < 0.5 else c for c in name).encode()
    members = _members(HEADER)
    i = NAMES.index(name) + 1
    members[i] = b'"' + escaped + b'"' + members[i][len(json.dumps(name)) :]
    return Case("unicode-escapes", "pass", name, pack(_join(members)))


def _h_metadata_ok(rng):
    header = dict(HEADER)
    how = rng.choice(["drop", "extra", "empty", "null"])
    if how == "drop":
        header.pop("__metadata__")
    elif how == "extra":
        header["__metadata__"] = {"format": "pt", "source": "fuzz", "note": "ünïcode"}
    elif how == "empty":
        header["__metadata__"] = {}
    else:
        header["__metadata__"] = None
    return Case("metadata-ok", "pass", how, pack(dump(header)))


def _h_extra_field(rng):
    header = copy.deepcopy(HEADER)
    header[rng.choice(NAMES)]["comment"] = rng.choice([1, "x", None, [1, 2], True])
    return Case("extra-field", "either", "an unknown field in one entry", pack(dump(header)))


def _h_data_values(rng):
    """Other finite values in a non-attention tensor: a valid, different model."""
    name = rng.choice([n for n in NAMES if n not in ATTENTION])
    begin, _ = HEADER[name]["data_offsets"]
    data = DATA[:begin] + struct.pack("<f", rng.uniform(-3, 3)) + DATA[begin + 4 :]
    return Case("data-values", "pass", name, pack(dump(HEADER), data))


HEADER_MUTATIONS = {
    _h_json_syntax: 45,
    _h_invalid_utf8: 15,
    _h_not_object: 10,
    _h_deep: 20,
    _h_duplicate: 20,
    _h_dtype_type: 15,
    _h_dtype_unknown: 15,
    _h_dtype_relabel: 40,
    _h_shape_type: 30,
    _h_shape_reshape: 30,
    _h_shape_size: 20,
    _h_offsets_type: 25,
    _h_offsets_shift: 20,
    _h_offsets_swap: 10,
    _h_metadata: 15,
    _h_rename: 35,
    _h_drop: 15,
    _h_length_field: 15,
    _h_file_size: 12,
    _h_bad_numbers: 12,
    _h_odd_strings: 8,
    _h_prefix: 8,
    _h_nan_data: 10,
    _h_reorder: 20,
    _h_whitespace: 15,
    _h_escapes: 12,
    _h_metadata_ok: 10,
    _h_extra_field: 8,
    _h_data_values: 10,
}


def header_cases(rng: random.Random) -> list[Case]:
    cases = [mutate(rng) for mutate, n in HEADER_MUTATIONS.items() for _ in range(n)]
    rng.shuffle(cases)
    return cases


@pytest.mark.slow
def test_header_mutations(tmp_path):
    rng = random.Random(SEED)
    cases = header_cases(rng)
    work = tmp_path / "headers"
    (work / "src").mkdir(parents=True)
    shutil.copy(TINY_LLAMA / "config.json", work / "src" / "config.json")
    tally = Tally("safetensors header mutations")
    for case in cases:
        (work / "src" / "model.safetensors").write_bytes(case.payload)
        run_conversion(case, work, tally)
    tally.report()
    tally.check(N_HEADER)
    assert tally.total(expect="refuse") > 400 and tally.total("ok", "refuse") == 0
