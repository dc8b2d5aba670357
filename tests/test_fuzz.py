"""Fuzzing the inputs: damaged safetensors headers, config.json files and converted
directories end in one clean line and exit code, never in a traceback or a false success.

Seeded and reproducible. Every case is classified before it runs:
- "refuse": the input is inconsistent (a broken header, a field of the wrong type, a
  config that does not describe the tensors): `convert gqa2mla` must exit 2 with one
  `error:` line and leave nothing on disk;
- "pass": the mutation leaves an equivalent input (keys reordered, whitespace, unicode
  escapes, a field restated with its default): the conversion must succeed;
- "either": the input is self-consistent but a different model (a valid rope_theta,
  the data of two same-shaped tensors swapped): both outcomes are fine.
Damaged converted directories (`convert verify`) must never PASS: exit 2 (refused) or
exit 1 (FAIL), never 0. Any exception other than those exits counts as a traceback.

Cases run in-process through click's CliRunner; a few go through `python -m convert`.
Counts are printed (`pytest -s` shows them) and asserted.
"""

import copy
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from convert.cli import main

from conftest import REPO, TINY_LLAMA

SEED = 20250612
N_HEADER, N_CONFIG, N_VERIFY = 500, 300, 50  # at least this many cases of each

RAW = (TINY_LLAMA / "model.safetensors").read_bytes()
HEADER_LEN = struct.unpack("<Q", RAW[:8])[0]
HEADER = json.loads(RAW[8 : 8 + HEADER_LEN])
DATA = RAW[8 + HEADER_LEN :]
CONFIG = json.loads((TINY_LLAMA / "config.json").read_text())
NAMES = [n for n in HEADER if n != "__metadata__"]
ATTENTION = [n for n in NAMES if ".self_attn." in n]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is ~20x faster than several fighting over a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    """One mutated input: its family, how it must end, and what was done (for failure messages)."""

    kind: str
    expect: str  # "refuse", "pass" or "either"; converted directories: "refuse" or "fail" (exit 1)
    what: str
    payload: object = None  # the file bytes / config text / damage function


# ------------------------------------------------------------------ running and judging


def _invoke(args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def outcome(result) -> tuple[str, str]:
    """('ok' | 'fail' | 'refused' | 'bad-message' | 'traceback', detail) of a CliRunner result."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "traceback", f"{type(result.exception).__name__}: {result.exception}"[:300]
    lines = result.stderr.strip().splitlines()
    if result.exit_code == 0:
        return "ok", ""
    if result.exit_code == 1:
        return "fail", result.output[-200:]
    if result.exit_code == 2:
        good = len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
        return ("refused" if good else "bad-message"), result.stderr[:300]
    return "traceback", f"exit {result.exit_code}: {result.output[-300:]}"


def _allowed(expect: str, got: str) -> bool:
    return {
        "refuse": got == "refused",
        "pass": got == "ok",
        "either": got in ("ok", "refused"),
        "fail": got == "fail",
    }[expect]


class Tally:
    """Outcomes per family and expectation; every case that broke a rule, with why."""

    def __init__(self, title: str):
        self.title, self.counts, self.broken = title, Counter(), []

    def record(self, case: Case, got: str, detail: str, leftovers: list[str]) -> None:
        self.counts[(case.kind, case.expect, got)] += 1
        if not _allowed(case.expect, got) or leftovers:
            self.broken.append(f"{case.kind} [{case.what}] expected {case.expect}, got {got} {detail} {leftovers}")

    def total(self, got: str | None = None, expect: str | None = None) -> int:
        return sum(n for (_, e, g), n in self.counts.items() if (got in (None, g)) and (expect in (None, e)))

    def report(self) -> None:
        print(f"\n{self.title}: {self.total()} cases")
        by_outcome, kinds = Counter(), Counter()
        for (kind, expect, got), n in self.counts.items():
            by_outcome[expect, got] += n
            kinds[kind] += n
        for expect in ("refuse", "pass", "either", "fail"):
            line = ", ".join(f"{g} {n}" for (e, g), n in sorted(by_outcome.items()) if e == expect)
            if line:
                print(f"  expected {expect:8s}: {line}")
        print("  families: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        print(f"  tracebacks: {self.total('traceback')}, broken rules: {len(self.broken)}")

    def check(self, minimum: int) -> None:
        assert self.total() >= minimum
        assert self.total("traceback") == 0, self.broken[:10]
        assert self.broken == [], f"{len(self.broken)} cases broke a rule:\n" + "\n".join(self.broken[:15])


def _run_conversion(case: Case, work: Path, tally: Tally) -> None:
    """Convert work/src into work/out; judge the outcome and what is left beside the output."""
    out = work / "out"
    got, detail = outcome(_invoke(["gqa2mla", work / "src", "-o", out, "--no-verify", "-q"]))
    expected_listing = {"src", "out"} if got == "ok" else {"src"}
    leftovers = sorted(set(os.listdir(work)) ^ expected_listing)
    tally.record(case, got, detail, leftovers)
    shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------ safetensors headers


def _pack(text: bytes, data: bytes = DATA) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


def _dump(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _members(header: dict) -> list[bytes]:
    return [json.dumps(k).encode() + b":" + json.dumps(v, separators=(",", ":")).encode() for k, v in header.items()]


def _join(members: list[bytes]) -> bytes:
    return b"{" + b",".join(members) + b"}"


def _with(name: str, field: str, value) -> bytes:
    """The header with one field of one tensor's entry replaced."""
    header = copy.deepcopy(HEADER)
    header[name][field] = value
    return _pack(_dump(header))


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _h_json_syntax(rng):
    text = _dump(HEADER)
    if rng.random() < 0.3:
        cut = rng.randrange(1, len(text) - 1)
        return Case("json-syntax", "refuse", f"header cut at {cut}", _pack(text[:cut]))
    positions = [i for i, c in enumerate(text) if chr(c) in '{}[]:,"']
    i = rng.choice(positions)
    return Case("json-syntax", "refuse", f"byte {i} {chr(text[i])!r} deleted", _pack(text[:i] + text[i + 1 :]))


def _h_invalid_utf8(rng):
    text = _dump(HEADER)
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"])
    name = rng.choice(NAMES).encode()
    i = text.index(b'"' + name + b'"') + 1 + rng.randrange(len(name))
    return Case("invalid-utf8", "refuse", f"{bad!r} in a tensor name", _pack(text[:i] + bad + text[i:]))


def _h_not_object(rng):
    text = rng.choice([b"[]", b'"header"', b"42", b"null", b"true", b"[" + _dump(HEADER) + b"]"])
    return Case("not-object", "refuse", text[:20].decode(), _pack(text))


def _h_deep(rng):
    depth = rng.choice([2, 5, 50, 900, 5000, 200000])
    where = rng.choice(["shape", "extra", "metadata", "top"])
    if where in ("shape", "extra"):
        header = copy.deepcopy(HEADER)
        name = rng.choice(NAMES)
        field = "shape" if where == "shape" else "extra"
        header[name][field] = "@@"
        text = _dump(header).replace(b'"@@"', _nested(depth))
    elif where == "metadata":
        text = _dump(HEADER).replace(b'{"format":"pt"}', b'{"format":' + _nested(depth) + b"}")
    else:
        text = b'{"deep":' + _nested(depth) + b"," + _dump(HEADER)[1:]
    return Case("deep-nesting", "refuse", f"{where} nested {depth}", _pack(text))


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
    return Case("duplicate-key", "refuse", which, _pack(_join(members)))


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
    return Case("dtype-relabel", "refuse", f"{name} F32->{code} {shape}", _pack(_dump(header)))


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
    return Case("offsets-swap", "either", f"{a} <-> {b}", _pack(_dump(header)))


def _h_metadata(rng):
    value = rng.choice([[], "pt", 3, {"format": 3}, {"format": None}, {"format": ["pt"]}, {"a": {"b": "c"}}, True])
    header = dict(HEADER)
    header["__metadata__"] = value
    return Case("metadata-type", "refuse", repr(value), _pack(_dump(header)))


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
    return Case("rename", "refuse", f"{name} -> {new!r}", _pack(_join(members)))


def _h_drop(rng):
    name = rng.choice(NAMES)
    header = {k: v for k, v in HEADER.items() if k != name}
    return Case("drop-entry", "refuse", name, _pack(_dump(header)))


def _h_length_field(rng):
    text = _dump(HEADER)
    delta = rng.choice([1, 4, 8, -1, -3, 2**40, 2**63, -len(text)])
    length = len(text) + delta
    raw = struct.pack("<Q", length % 2**64) + text + DATA
    return Case("length-field", "refuse", f"header length {delta:+d}", raw)


def _h_file_size(rng):
    raw = _pack(_dump(HEADER))
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
    return Case("bad-numbers", expect, f"{name} shape {token[:20]!r}", _pack(_dump(header).replace(b'"@@"', token)))


def _h_odd_strings(rng):
    name = rng.choice(NAMES)
    members = _members(HEADER)
    i = NAMES.index(name) + 1
    new = rng.choice([b'"\\ud800' + name.encode() + b'"', b'"\xef\xbb\xbf' + name.encode() + b'"'])
    members[i] = new + members[i][len(json.dumps(name)) :]
    return Case("odd-strings", "refuse", f"{name} as {new[:12]!r}", _pack(_join(members)))


def _h_prefix(rng):
    text = rng.choice([b"\xef\xbb\xbf", b"\x00", b"\n\n\n"]) + _dump(HEADER)
    expect = "pass" if text.startswith(b"\n") else "refuse"  # leading whitespace is valid JSON
    return Case("prefix", expect, repr(text[:3]), _pack(text))


def _h_nan_data(rng):
    """A NaN/Inf inside an attention weight: found while converting, after the output was started."""
    name = rng.choice(ATTENTION)
    begin, end = HEADER[name]["data_offsets"]
    at = begin + 4 * rng.randrange((end - begin) // 4)
    value = struct.pack("<f", rng.choice([float("nan"), float("inf"), float("-inf")]))
    return Case("non-finite", "refuse", f"{name} @{at}", _pack(_dump(HEADER), DATA[:at] + value + DATA[at + 4 :]))


# --- equivalent headers and self-consistent others


def _h_reorder(rng):
    items = list(HEADER.items())
    rng.shuffle(items)
    header = {k: (dict(sorted(v.items(), key=lambda _: rng.random())) if k != "__metadata__" else v) for k, v in items}
    return Case("reorder", "pass", "entries and fields shuffled", _pack(_dump(header)))


def _h_whitespace(rng):
    how = rng.choice(["indent", "spaces", "padding", "newlines"])
    if how == "indent":
        text = json.dumps(HEADER, indent=rng.choice([1, 2, 4])).encode()
    elif how == "spaces":
        text = json.dumps(HEADER).encode()
    elif how == "padding":
        text = _dump(HEADER) + b" " * rng.randrange(1, 64)
    else:
        text = _dump(HEADER).replace(b",", b",\n")
    return Case("whitespace", "pass", how, _pack(text))


def _h_escapes(rng):
    name = rng.choice(NAMES)
    escaped = "".join(f"\\u{ord(c):04x}" if rng.random() < 0.5 else c for c in name).encode()
    members = _members(HEADER)
    i = NAMES.index(name) + 1
    members[i] = b'"' + escaped + b'"' + members[i][len(json.dumps(name)) :]
    return Case("unicode-escapes", "pass", name, _pack(_join(members)))


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
    return Case("metadata-ok", "pass", how, _pack(_dump(header)))


def _h_extra_field(rng):
    header = copy.deepcopy(HEADER)
    header[rng.choice(NAMES)]["comment"] = rng.choice([1, "x", None, [1, 2], True])
    return Case("extra-field", "either", "an unknown field in one entry", _pack(_dump(header)))


def _h_data_values(rng):
    """Other finite values in a non-attention tensor: a valid, different model."""
    name = rng.choice([n for n in NAMES if n not in ATTENTION])
    begin, _ = HEADER[name]["data_offsets"]
    data = DATA[:begin] + struct.pack("<f", rng.uniform(-3, 3)) + DATA[begin + 4 :]
    return Case("data-values", "pass", name, _pack(_dump(HEADER), data))


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


def test_header_mutations(tmp_path):
    rng = random.Random(SEED)
    cases = header_cases(rng)
    work = tmp_path / "headers"
    (work / "src").mkdir(parents=True)
    shutil.copy(TINY_LLAMA / "config.json", work / "src" / "config.json")
    tally = Tally("safetensors header mutations")
    for case in cases:
        (work / "src" / "model.safetensors").write_bytes(case.payload)
        _run_conversion(case, work, tally)
    tally.report()
    tally.check(N_HEADER)
    assert tally.total(expect="refuse") > 400 and tally.total("ok", "refuse") == 0


# ------------------------------------------------------------------ config.json


def _config_text(changes: dict, drop: tuple = ()) -> str:
    config = {k: v for k, v in CONFIG.items() if k not in drop}
    return json.dumps({**config, **changes})


def _replace_value(field: str, raw: str) -> str:
    """config.json with `field`'s value written as raw JSON text (huge numbers, NaN, …)."""
    return _config_text({field: "@@"}).replace('"@@"', raw)


INT_FIELDS = {
    "num_attention_heads": [1, 2, 8, 3],
    "num_key_value_heads": [1, 4, 3],
    "num_hidden_layers": [1, 3, 4],
    "hidden_size": [32, 48, 128],
    "head_dim": [8, 32],
    "vocab_size": [127, 129, 256],
    "intermediate_size": [95, 97, 192],
    "max_position_embeddings": [],
}


def _c_int_type(rng):
    field = rng.choice(list(INT_FIELDS))
    value = CONFIG[field]
    bad = rng.choice([str(value), value + 0.5, float(value), True, [value], {"v": value}, 0, -value, False])
    return Case("int-type", "refuse", f"{field}={bad!r}", _config_text({field: bad}))


def _c_int_range(rng):
    field = rng.choice(list(INT_FIELDS))
    raw = rng.choice([str(2**31), str(2**63), str(10**30), "1" + "0" * 5000, "NaN", "Infinity", "-Infinity", "1e3"])
    return Case("int-range", "refuse", f"{field}={raw[:12]}", _replace_value(field, raw))


def _c_int_value(rng):
    field = rng.choice([f for f, values in INT_FIELDS.items() if values])
    value = rng.choice(INT_FIELDS[field])
    return Case("int-inconsistent", "refuse", f"{field}={value}", _config_text({field: value}))


def _c_null_or_absent(rng):
    field = rng.choice(list(INT_FIELDS) + ["rms_norm_eps", "tie_word_embeddings", "hidden_act", "model_type"])
    absent = rng.random() < 0.5
    # null/absent means transformers' default: equivalent for head_dim (64 / 4 = 16), a
    # different model for max_position_embeddings and the activation; refused where the
    # default differs from this checkpoint or null means nothing.
    if field == "head_dim":
        expect = "pass"
    elif absent and field in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act"):
        expect = "either"
    elif absent and field == "model_type":
        expect = "refuse"  # a bare file: --arch needed
    else:
        expect = "refuse"
    text = _config_text({}, drop=(field,)) if absent else _config_text({field: None})
    return Case("null-or-absent", expect, f"{field} {'absent' if absent else 'null'}", text)


def _c_numbers(rng):
    field = rng.choice(["rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout"])
    bad = rng.choice(["1e-6", -1e-6, 0 if field != "initializer_range" else -1, [1e-6], True, {"x": 1}])
    if field == "attention_dropout" and bad == 0:
        bad = 2.0
    return Case("numbers", "refuse", f"{field}={bad!r}", _config_text({field: bad}))


def _c_number_constants(rng):
    field = rng.choice(["rms_norm_eps", "rope_theta", "initializer_range"])
    raw = rng.choice(["NaN", "Infinity", "-Infinity"])
    return Case("numbers", "refuse", f"{field}={raw}", _replace_value(field, raw))


ROPE_BAD = [
    "default",
    ["default"],
    10000,
    True,
    {"rope_type": "foo"},
    {"rope_type": 3},
    {"rope_type": None, "rope_theta": 10000.0},
    {"rope_type": "linear"},
    {"rope_type": "linear", "factor": "2"},
    {"rope_type": "linear", "factor": -2.0},
    {"rope_type": "linear", "factor": 0},
    {"rope_type": "default", "rope_theta": "10000"},
    {"rope_type": "default", "rope_theta": 0},
    {"rope_type": "default", "rope_theta": -1.0},
    {"rope_type": "default", "rope_theta": None},
    {"rope_type": "llama3", "factor": 8.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 4.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 6.5,
    },
    {"rope_type": "yarn"},
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"},
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
    {"rope_type": "longrope", "short_factor": "x", "long_factor": [1.0] * 8},
    {"rope_type": "default", "type": "linear", "factor": 2.0},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
    {"rope_type": "default", "partial_rotary_factor": 0},
    {"rope_type": "default", "partial_rotary_factor": 2},
    {"rope_type": "default", "truncate": "no"},
]
ROPE_OTHER = [  # valid, another model
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 500000.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 10000.0},
    None,
    {},
]
ROPE_SAME = [
    {"type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 10000},
    {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0},
]


def _c_rope(rng):
    field = rng.choice(["rope_parameters", "rope_parameters", "rope_scaling"])
    roll = rng.random()
    if roll < 0.7:
        value, expect = rng.choice(ROPE_BAD), "refuse"
    elif roll < 0.85 or field == "rope_scaling":
        value, expect = rng.choice(ROPE_OTHER), "either"
    else:
        value, expect = rng.choice(ROPE_SAME), "pass"
    return Case("rope", expect, f"{field}={value!r}"[:100], _config_text({field: value}))


FLAGS_AND_NAMES = {
    "tie_word_embeddings": (["false", 0, 1, [False]], [True]),
    "attention_bias": (["false", 1, None, True], []),  # true: the biases it promises are absent
    "mlp_bias": (["no", 0, True], []),
    "hidden_act": ([3, "", ["silu"], None], ["gelu", "relu"]),
    "model_type": (["qwen3", "gpt2", "", 3, None, ["llama"], "qwen2", "LLAMA"], ["mistral"]),
    "bos_token_id": (["1", -1, 1.5, [1, "2"], True, [], 2**40], [None, 5, [1, 2]]),
    "eos_token_id": (["2", -2, {"id": 2}, [2, None]], [[2, 3], None]),
    "layer_types": ([["full_attention"], ["bogus", "bogus"], "full_attention", [1, 2]], [["full_attention"] * 2]),
    "dtype": ([3, [], ""], ["bfloat16", None]),
    "use_cache": (["yes", 1], [False]),
    "partial_rotary_factor": ([0.5, 0, 2, "1"], []),
    "sliding_window": ([0, -5, "5", 5.5], [None]),
}


def _c_flags_and_names(rng):
    field = rng.choice(list(FLAGS_AND_NAMES))
    bad, other = FLAGS_AND_NAMES[field]
    if other and rng.random() < 0.3:
        value = rng.choice(other)
        return Case("flags-names", "either", f"{field}={value!r}", _config_text({field: value}))
    value = rng.choice(bad)
    return Case("flags-names", "refuse", f"{field}={value!r}", _config_text({field: value}))


def _c_file(rng):
    text = _config_text({})
    how = rng.choice(["syntax", "utf8", "array", "duplicate", "duplicate-same", "deep", "huge-deep", "empty", "bom"])
    if how == "syntax":
        i = rng.choice([i for i, c in enumerate(text) if c in '{}[]:,"'])
        text = text[:i] + text[i + 1 :]
    elif how == "utf8":
        return Case("file", "refuse", how, text.encode().replace(b'"llama"', b'"ll\xffama"'))
    elif how == "array":
        text = "[" + text + "]"
    elif how == "duplicate":
        text = text[:-1] + ', "num_attention_heads": 8}'
    elif how == "duplicate-same":
        text = text[:-1] + ', "num_attention_heads": 4}'
    elif how == "deep":
        text = text[:-1] + ', "x": ' + "[" * 40 + "]" * 40 + "}"
    elif how == "huge-deep":
        text = text[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"
    elif how == "empty":
        text = ""
    else:
        return Case("file", "refuse", how, b"\xef\xbb\xbf" + text.encode())
    return Case("file", "refuse", how, text)


def _c_equivalent(rng):
    how = rng.choice(["reorder", "indent", "unknown-field", "mild-nesting", "restate-theta", "drop-optional"])
    config = dict(CONFIG)
    if how == "reorder":
        items = list(config.items())
        rng.shuffle(items)
        return Case("equivalent", "pass", how, json.dumps(dict(items)))
    if how == "indent":
        return Case("equivalent", "pass", how, json.dumps(config, indent=rng.choice([1, 2, 8])))
    if how == "unknown-field":
        config["fuzz_note"] = rng.choice([1, "x", None, [1, {"a": 2}]])
    elif how == "mild-nesting":
        config["fuzz_nest"] = json.loads("[" * 10 + "]" * 10)
    elif how == "restate-theta":
        config["rope_theta"] = 10000.0
    else:
        config.pop(rng.choice(["pad_token_id", "architectures", "transformers_version", "use_cache", "dtype"]))
    return Case("equivalent", "pass", how, json.dumps(config))


def _c_random_int(rng):
    """A random integer in a random int field: equal to the original passes, anything else is refused."""
    field = rng.choice([f for f in INT_FIELDS if f != "max_position_embeddings"])
    value = rng.choice([rng.randrange(-3, 300), CONFIG[field]])
    expect = "pass" if value == CONFIG[field] else "refuse"
    if field == "head_dim" and value == CONFIG["hidden_size"] // CONFIG["num_attention_heads"]:
        expect = "pass"
    return Case("random-int", expect, f"{field}={value}", _config_text({field: value}))


CONFIG_MUTATIONS = {
    _c_int_type: 40,
    _c_int_range: 30,
    _c_int_value: 25,
    _c_null_or_absent: 25,
    _c_numbers: 20,
    _c_number_constants: 10,
    _c_rope: 50,
    _c_flags_and_names: 50,
    _c_file: 25,
    _c_equivalent: 20,
    _c_random_int: 25,
}


def config_cases(rng: random.Random) -> list[Case]:
    cases = [mutate(rng) for mutate, n in CONFIG_MUTATIONS.items() for _ in range(n)]
    rng.shuffle(cases)
    return cases


def test_config_mutations(tmp_path):
    rng = random.Random(SEED + 1)
    cases = config_cases(rng)
    work = tmp_path / "configs"
    (work / "src").mkdir(parents=True)
    shutil.copy(TINY_LLAMA / "model.safetensors", work / "src" / "model.safetensors")
    tally = Tally("config.json mutations")
    for case in cases:
        text = case.payload
        (work / "src" / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        _run_conversion(case, work, tally)
    tally.report()
    tally.check(N_CONFIG)
    assert tally.total(expect="refuse") > 200 and tally.total("ok", "refuse") == 0


# ------------------------------------------------------------------ converted directories (`convert verify`)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """One conversion of the tiny Llama, sharded (5 files + index) so the index can be damaged too."""
    out = tmp_path_factory.mktemp("converted") / "tiny-mla"
    torch.set_num_threads(1)
    result = _invoke(["gqa2mla", TINY_LLAMA, "-o", out, "--no-verify", "-q", "--max-shard-size", "100KB"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").is_file()
    return out


def _read_json(path: Path):
    return json.loads(path.read_text())


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def _index(d: Path) -> dict:
    return _read_json(d / "model.safetensors.index.json")


def _shard_of(d: Path, tensor: str) -> Path:
    return d / _index(d)["weight_map"][tensor]


def _edit_config(fn):
    def damage(d: Path) -> None:
        config = _read_json(d / "config.json")
        fn(config)
        _write_json(d / "config.json", config)

    return damage


def _set(*path_and_value):
    """Set config[path...] = value (a missing last key is added; `DROP` removes it)."""
    *path, value = path_and_value

    def edit(config):
        target = config
        for key in path[:-1]:
            target = target[key]
        if value is DROP:
            target.pop(path[-1]) if isinstance(target, dict) else target.pop(path[-1])
        else:
            target[path[-1]] = value

    return _edit_config(edit)


class _Drop:
    def __repr__(self) -> str:
        return "<removed>"


DROP = _Drop()


def _edit_header(tensor: str, fn):
    """Edit one tensor's entry in its shard's header (the data stays where it is)."""

    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        fn(header)
        shard.write_bytes(_pack(_dump(header), raw[8 + n :]))

    return damage


def _rename(tensor: str, new: str, index_too: bool = True):
    def edit(header):
        header[new] = header.pop(tensor)

    def damage(d: Path) -> None:
        _edit_header(tensor, edit)(d)
        if index_too:
            index = _index(d)
            index["weight_map"][new] = index["weight_map"].pop(tensor)
            _write_json(d / "model.safetensors.index.json", index)

    return damage


def _tensors_of(shard: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(shard)


def _save_shard(shard: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(shard), metadata={"format": "pt"})


def _perturb(tensor: str, fn):
    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        tensors = _tensors_of(shard)
        tensors[tensor] = fn(tensors[tensor].clone())
        _save_shard(shard, tensors)

    return damage


def _remove(tensor: str, index_too: bool = True, shard_too: bool = True):
    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        if shard_too:
            tensors = _tensors_of(shard)
            del tensors[tensor]
            _save_shard(shard, tensors)
        if index_too:
            index = _index(d)
            del index["weight_map"][tensor]
            _write_json(d / "model.safetensors.index.json", index)

    return damage


def _add(tensor: str, value):
    def damage(d: Path) -> None:
        index = _index(d)
        shard_name = sorted(set(index["weight_map"].values()))[-1]
        tensors = _tensors_of(d / shard_name)
        tensors[tensor] = value
        _save_shard(d / shard_name, tensors)
        index["weight_map"][tensor] = shard_name
        _write_json(d / "model.safetensors.index.json", index)

    return damage


def _set_index(fn):
    def damage(d: Path) -> None:
        index = _index(d)
        fn(index)
        _write_json(d / "model.safetensors.index.json", index)

    return damage


def _write_file(name: str, data: bytes | None):
    def damage(d: Path) -> None:
        if data is None:
            (d / name).unlink()
        else:
            (d / name).write_bytes(data)

    return damage


def _map_to(tensor: str, shard):
    def edit(index):
        shards = sorted(set(index["weight_map"].values()))
        here = index["weight_map"][tensor]
        index["weight_map"][tensor] = shard if shard is not None else next(s for s in shards if s != here)

    return _set_index(edit)


ATTN0 = "model.layers.0.self_attn."
ATTN1 = "model.layers.1.self_attn."


def _row_plus_one(t):
    t[0] += 1.0
    return t


def verify_cases(converted: Path) -> list[Case]:
    """Damaged copies of one converted directory; each must fail verification or be refused."""
    config = _read_json(converted / "config.json")
    version = config["mla"]["format_version"]
    own_type = config["model_type"]  # `convert_mla` from format 2 on, the source's before
    cases = []

    def add(kind, expect, what, damage):
        cases.append(Case(kind, expect, what, damage))

    # the mla section's own fields
    for field, values in {
        "format_version": [version + 1, 99, 0, -1, str(version), None, 1.5, True],
        "n_layers": [1, 3, 0, "2", None, 2.0],
        "n_heads": [8, 2, "4"],
        "n_kv_heads": [1, 4, 3],
        "head_dim": [8, 32],
        "hidden_size": [32, 65],
        "layout": ["foo", 3, "factored"],
        "latent": ["joint", "foo"],
        "head_map": ["foo", None],
        "source_architecture": ["mistral", "qwen2", "seed", "gpt2", None],
        "rope": [None, "interleaved"],
        "causal": [False, "yes"],
        "layer_prefix": ["layers.{i}.", "model.layers.{x}.", "model.layers.{i}.self_attn", 3, "{0}{1}"],
        "softmax_scale": [0, -0.25, "0.25", None, float("nan")],
        "notes": ["x", [1]],
        "compression": ["x", [1]],
        "layers": [[], "x", None],
        "converter": [None, 3],
    }.items():
        for value in values:
            add("mla-field", "refuse", f"mla.{field}={value!r}", _set("mla", field, value))
    if version >= 2:
        for value in ["qwen3", "mistral", 3, None]:
            add("mla-field", "refuse", f"mla.source_model_type={value!r}", _set("mla", "source_model_type", value))
        if version > 2 or own_type is not None:
            add("mla-field", "refuse", "mla.format_version=1 (older)", _set("mla", "format_version", 1))
    for value in ["x", [], None, {}]:
        add("mla-field", "refuse", f"mla={value!r}", _set("mla", value))
    add("mla-field", "refuse", "mla removed", _set("mla", DROP))
    for value in [0.5, 0.125]:
        add("mla-field", "fail", f"mla.softmax_scale={value}", _set("mla", "softmax_scale", value))

    # one layer entry
    for field, value in [
        ("rank_k", 16),
        ("rank_k", 33),
        ("rank_k", 0),
        ("rank_k", "32"),
        ("rank_v", 16),
        ("rank_v", None),
        ("rank_kv", 32),
        ("rank_v", DROP),
        ("key_freq_index", list(range(8))),
        ("key_freq_index", None),
        ("key_freq_index", [8] * 16),
        ("key_freq_index", [-1] * 16),
        ("key_freq_index", ["0"] * 16),
        ("bias", ["q_absorbed"]),
        ("bias", ["k_down"]),
        ("bias", "x"),
        ("bias", ["q_proj"]),
        ("retained_energy", "x"),
        ("retained_energy", {"k": "1"}),
        ("factor_error", [1]),
    ]:
        add("mla-layer", "refuse", f"layers[1].{field}={value!r}", _set("mla", "layers", 1, field, value))
    add("mla-layer", "refuse", "layers[0]='x'", _set("mla", "layers", 0, "x"))
    add("mla-layer", "refuse", "last layer entry dropped", _set("mla", "layers", 1, DROP))
    freq = config["mla"]["layers"][0]["key_freq_index"]
    add("mla-layer", "fail", "key_freq_index reversed", _set("mla", "layers", 0, "key_freq_index", freq[::-1]))

    # the source fields beside the section
    for field, value in [
        ("num_attention_heads", "4"),
        ("num_attention_heads", 0),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("num_hidden_layers", 1),
        ("num_hidden_layers", 3),
        ("vocab_size", 64),
        ("vocab_size", "128"),
        ("vocab_size", None),
        ("hidden_size", 32),
        ("intermediate_size", 95),
        ("rope_parameters", "x"),
        ("rope_parameters", {"rope_type": "foo"}),
        ("rms_norm_eps", "x"),
        ("rms_norm_eps", -1.0),
        ("hidden_act", "bogus"),
        ("tie_word_embeddings", "yes"),
        ("layer_types", ["full_attention"]),
        ("model_type", "qwen3"),
    ] + ([("model_type", "llama")] if own_type != "llama" else []):
        add("config-field", "refuse", f"{field}={value!r}", _set(field, value))
    add("config-field", "refuse", "vocab_size removed", _set("vocab_size", DROP))
    text = (converted / "config.json").read_bytes().rstrip()
    for what, data in [
        ("invalid JSON", text[:-2]),
        ("not an object", b"[" + text + b"]"),
        ("duplicate key", text[:-1] + b', "vocab_size": 64}'),
        ("deep nesting", text[:-1] + b', "x": ' + b"[" * 50000 + b"]" * 50000 + b"}"),
        ("empty", b""),
        ("invalid UTF-8", text.replace(b'"silu"', b'"si\xfflu"')),
        ("removed", None),
    ]:
        add("config-file", "refuse", what, _write_file("config.json", data))

    # tensors
    for tensor in [
        ATTN0 + "k_down.weight",
        ATTN1 + "o_absorbed.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        add("tensor-removed", "refuse", tensor, _remove(tensor))
    add("tensor-removed", "refuse", "index entry only", _remove(ATTN0 + "q_absorbed.weight", shard_too=False))
    for tensor, new in [
        (ATTN0 + "v_down.weight", ATTN0 + "v_proj.weight"),
        ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight"),
        (ATTN1 + "q_absorbed.weight", "model.layers.2.self_attn.q_absorbed.weight"),
    ]:
        add("tensor-renamed", "refuse", f"{tensor} -> {new}", _rename(tensor, new))
    add(
        "tensor-renamed",
        "refuse",
        "shard only",
        _rename(ATTN1 + "k_down.weight", ATTN1 + "k_up.weight", index_too=False),
    )
    for tensor in [
        ATTN0 + "k_down.weight",
        "model.embed_tokens.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]:

        def reshape(header, tensor=tensor):
            dims = header[tensor]["shape"]
            header[tensor]["shape"] = dims[::-1] if len(dims) > 1 else [8, dims[0] // 8]

        add("tensor-reshaped", "refuse", tensor, _edit_header(tensor, reshape))
    for tensor in [ATTN1 + "q_absorbed.weight", "model.layers.0.mlp.down_proj.weight"]:
        add(
            "dtype-relabel",
            "refuse",
            f"{tensor} F32->I32",
            _edit_header(tensor, lambda h, t=tensor: h[t].update(dtype="I32")),
        )
    for tensor, fn in [
        (ATTN0 + "k_down.weight", _row_plus_one),
        (ATTN1 + "v_down.weight", lambda t: t * 1.5),
        (ATTN0 + "q_absorbed.weight", lambda t: t.flip(0)),
        (ATTN1 + "o_absorbed.weight", lambda t: t * 0),
        ("model.embed_tokens.weight", lambda t: t + 0.5),  # every row: verify samples only some token ids
        ("model.layers.0.mlp.down_proj.weight", lambda t: t * 1.5),
        ("model.layers.1.input_layernorm.weight", lambda t: t + 0.5),
        ("lm_head.weight", lambda t: t.flip(0)),
        (ATTN0 + "v_down.weight", lambda t: t.fill_(float("nan"))),
    ]:
        add("tensor-perturbed", "fail", tensor, _perturb(tensor, fn))
    for tensor, shape in [
        (ATTN0 + "q_proj.weight", (64, 64)),
        ("model.layers.2.mlp.up_proj.weight", (96, 64)),
        ("extra.weight", (4,)),
    ]:
        add("tensor-added", "refuse", tensor, _add(tensor, torch.zeros(shape)))

    # the shard index and the shard files
    index_text = (converted / "model.safetensors.index.json").read_bytes()
    first_shard = sorted(set(_index(converted)["weight_map"].values()))[0]
    add("index", "refuse", "invalid JSON", _write_file("model.safetensors.index.json", index_text[:-3]))
    add("index", "refuse", "weight_map missing", _set_index(lambda i: i.pop("weight_map")))
    add("index", "refuse", "weight_map a list", _set_index(lambda i: i.update(weight_map=[])))
    add("index", "refuse", "a value not a string", _set_index(lambda i: i["weight_map"].update({"lm_head.weight": 3})))
    add("index", "refuse", "tensor mapped to another shard", _map_to("model.norm.weight", None))
    add(
        "index",
        "refuse",
        "tensor mapped to a missing shard",
        _map_to("model.norm.weight", "model-00009-of-00009.safetensors"),
    )
    add("index", "refuse", "tensor mapped outside the directory", _map_to("model.norm.weight", "../model.safetensors"))
    add(
        "index",
        "refuse",
        "lists a tensor no shard has",
        _set_index(lambda i: i["weight_map"].update({"ghost.weight": first_shard})),
    )
    add("index", "refuse", "index removed", _write_file("model.safetensors.index.json", None))
    add("shard", "refuse", "a shard removed", _write_file(first_shard, None))
    shard_bytes = (converted / first_shard).read_bytes()
    add("shard", "refuse", "a shard truncated", _write_file(first_shard, shard_bytes[:-100]))
    add("shard", "refuse", "a shard with trailing bytes", _write_file(first_shard, shard_bytes + b"\0" * 8))
    add(
        "shard",
        "refuse",
        "a shard's header broken",
        _write_file(first_shard, shard_bytes[:20] + b"#" + shard_bytes[21:]),
    )
    return cases


def test_damaged_converted_directories_never_pass(tmp_path, converted):
    cases = verify_cases(converted)
    tally = Tally("damaged converted directories (convert verify)")
    for i, case in enumerate(cases):
        work = tmp_path / f"v{i}"
        shutil.copytree(converted, work / "conv")
        case.payload(work / "conv")
        listing = sorted(os.listdir(work / "conv"))
        args = ["verify", TINY_LLAMA, work / "conv", "--dtype", "float32", "--tokens", "16", "-q"]
        got, detail = outcome(_invoke(args))
        leftovers = sorted(set(os.listdir(work)) ^ {"conv"}) + sorted(set(os.listdir(work / "conv")) ^ set(listing))
        tally.record(case, got, detail, leftovers)
        shutil.rmtree(work)
    tally.report()
    tally.check(N_VERIFY)
    assert tally.total("ok") == 0


def test_undamaged_converted_directory_passes(converted):
    """The guard on the guard: the directory every damage starts from verifies."""
    result = _invoke(["verify", TINY_LLAMA, converted, "--dtype", "float32", "--tokens", "16", "-q"])
    assert outcome(result)[0] == "ok", result.output


# ------------------------------------------------------------------ through a real process


def _subprocess_case(tmp_path: Path, name: str, args: list, setup) -> subprocess.Popen:
    work = tmp_path / name
    work.mkdir()
    setup(work)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "convert", *[str(a).format(work=work) for a in args]]
    return subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_refusals_through_a_real_process(tmp_path, converted):
    """The same refusals from `python -m convert`: exit 2, one `error:` line, nothing written.
    (Three processes started together: each spends most of its time importing torch and transformers.)"""

    def relabelled_header(work):
        shutil.copytree(TINY_LLAMA, work / "src")
        header = copy.deepcopy(HEADER)
        header[ATTENTION[0]]["dtype"] = "I32"  # same bytes: converted into zeros before
        (work / "src" / "model.safetensors").write_bytes(_pack(_dump(header)))

    def fewer_layers(work):
        shutil.copytree(TINY_LLAMA, work / "src")
        _write_json(work / "src" / "config.json", {**CONFIG, "num_hidden_layers": 1})

    def newer_format(work):
        shutil.copytree(converted, work / "conv")
        _set("mla", "format_version", 99)(work / "conv")

    convert_args = ["gqa2mla", "{work}/src", "-o", "{work}/out", "--no-verify", "-q"]
    verify_args = ["verify", TINY_LLAMA, "{work}/conv", "--dtype", "float32", "--tokens", "16", "-q"]
    cases = {
        "relabelled": (convert_args, relabelled_header, ATTENTION[0]),
        "fewer-layers": (convert_args, fewer_layers, "num_hidden_layers"),
        "newer-format": (verify_args, newer_format, "upgrade"),
    }
    running = {name: _subprocess_case(tmp_path, name, args, setup) for name, (args, setup, _) in cases.items()}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        print(f"\n{name}: exit {process.returncode}, {stderr.strip()}")
        assert process.returncode == 2, (name, stdout, stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and cases[name][2] in lines[0], stderr
        assert "Traceback" not in stderr
        assert sorted(os.listdir(tmp_path / name)) in (["src"], ["conv"]), os.listdir(tmp_path / name)
