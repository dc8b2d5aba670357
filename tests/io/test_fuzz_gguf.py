"""Fuzzing GGUF headers (tests/fuzzing.py): a damaged or hostile GGUF file ends in one `ConvertError`
line (exit 2 with nothing on disk through the command line) or reads as a valid checkpoint, never in
another exception, a hang or an allocation out of proportion to the file.

The mutations are those behind GGUF parsers' published vulnerabilities: counts, lengths, dimensions,
types and offsets overwritten with absurd values, bad magic and versions, flipped bytes, truncations."""

import random
import signal
import struct
import tracemalloc
from pathlib import Path

import fuzzing
import gguf
import pytest
from fuzzing import SEED, Case, Tally, run_conversion
from test_gguf import Q, tiny, write_gguf

from convert.errors import ConvertError
from convert.io import model_files, open_checkpoint

N_API, N_CLI = 800, 60  # cases read through the API, and converted through the command line
CASE_SECONDS = 20  # a case taking longer is a hang
CASE_BYTES = 64 * 2**20  # Python allocations of one case (the file is ~0.2 MB)

one_thread = fuzzing.one_thread  # autouse: the cases run on one torch thread

#: values a length, count or dimension is overwritten with
ABSURD = [0, 1, 2, 3, 5, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> bytes:
    """A small valid GGUF: the tiny Llama, Q8_0 weights and F32 vectors, with its tokenizer."""
    path = write_gguf(tiny("llama"), tmp_path_factory.mktemp("gguf") / "base.gguf", Q.Q8_0)
    return path.read_bytes()


def fields(data: bytes) -> list[tuple[str, int, str]]:
    """(what, offset, struct format) of every count, length, type, dimension and offset of the header,
    found by walking it (an implementation apart from the reader's)."""
    out = [("version", 4, "I"), ("tensor count", 8, "Q"), ("key count", 16, "Q")]
    pos, (n_tensors, n_kv) = 24, struct.unpack_from("<QQ", data, 8)

    def string(what):
        nonlocal pos
        out.append((f"{what} length", pos, "Q"))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    widths = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for i in range(n_kv):
        string(f"key {i}")
        out.append((f"key {i} type", pos, "I"))
        kind = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if kind == 8:
            string(f"key {i} string")
        elif kind == 9:
            element, count = struct.unpack_from("<IQ", data, pos)
            out += [(f"key {i} element type", pos, "I"), (f"key {i} array length", pos + 4, "Q")]
            pos += 12
            for j in range(count):
                if element != 8:
                    pos += widths[element]
                elif j < 3:  # the first few items' lengths are fields too
                    string(f"key {i} item {j}")
                else:
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        else:
            out.append((f"key {i} value", pos, {1: "B", 2: "H", 4: "I", 8: "Q"}[widths[kind]]))
            pos += widths[kind]
    for i in range(n_tensors):
        string(f"tensor {i} name")
        n_dims = struct.unpack_from("<I", data, pos)[0]
        out.append((f"tensor {i} n_dims", pos, "I"))
        pos += 4
        out += [(f"tensor {i} dim {j}", pos + 8 * j, "Q") for j in range(n_dims)]
        pos += 8 * n_dims
        out += [(f"tensor {i} type", pos, "I"), (f"tensor {i} offset", pos + 4, "Q")]
        pos += 12
    return out


def header_end(data: bytes) -> int:
    what, at, fmt = fields(data)[-1]
    return at + struct.calcsize(fmt)


# ------------------------------------------------------------------ mutations


def _overwrite(rng, data):
    what, at, fmt = rng.choice(fields(data))
    width = struct.calcsize(fmt)
    old = struct.unpack_from("<" + fmt, data, at)[0]
    new = rng.choice([*ABSURD, old + 1, old - 1, old * 2, old + rng.randrange(1, 4096), len(data)]) % 2 ** (8 * width)
    payload = data[:at] + new.to_bytes(width, "little") + data[at + width :]
    return Case("field", "either", f"{what} {old} -> {new}", payload)


def _absurd_count(rng, data):
    at, what = rng.choice([(8, "tensor count"), (16, "key count")])
    new = rng.choice([2**20 + 1, 2**32, 2**40, 2**63, 2**64 - 1])
    return Case("counts", "refuse", f"{what} {new}", data[:at] + struct.pack("<Q", new) + data[at + 8 :])


def _magic_version(rng, data):
    how = rng.choice(["magic", "version", "big-endian", "v1"])
    if how == "magic":
        return Case("magic", "refuse", how, rng.choice([b"GGUG", b"FUGG", b"\0\0\0\0", b"ggml"]) + data[4:])
    version = {"version": rng.choice([0, 4, 99, 2**32 - 1]), "big-endian": 3 << 24, "v1": 1}[how]
    return Case("magic", "refuse", f"{how} {version}", data[:4] + struct.pack("<I", version) + data[8:])


def _truncate(rng, data):
    at = rng.choice([0, 3, 4, 8, 23, 24, rng.randrange(24, header_end(data)), rng.randrange(len(data) - 1)])
    return Case("truncate", "refuse", f"cut at {at} of {len(data)}", data[:at])


def _flip_header(rng, data):
    out = bytearray(data)
    positions = [rng.randrange(4, header_end(data)) for _ in range(rng.choice([1, 2, 4, 16]))]
    for at in positions:
        out[at] ^= 1 << rng.randrange(8)
    return Case("flip", "either", f"bits at {positions[:4]}", bytes(out))


def _random_bytes(rng, data):
    at = rng.randrange(4, header_end(data))
    n = rng.choice([1, 8, 64])
    return Case("garbage", "either", f"{n} random bytes at {at}", data[:at] + rng.randbytes(n) + data[at + n :])


def _insert_delete(rng, data):
    at = rng.randrange(24, header_end(data))
    if rng.random() < 0.5:
        return Case("shift", "either", f"insert at {at}", data[:at] + rng.randbytes(rng.choice([1, 4, 8])) + data[at:])
    return Case("shift", "either", f"delete at {at}", data[:at] + data[at + rng.choice([1, 4, 8]) :])


def _append(rng, data):
    return Case("append", "pass", "bytes after the data", data + b"\0" * rng.choice([1, 31, 4096]))


def _data_bytes(rng, data):
    """Bytes of tensor data changed: a different (perhaps non-finite: then refused by the conversion)
    model, read all the same."""
    at = rng.randrange(header_end(data) + 64, len(data))
    return Case("data", "either", f"data byte {at}", data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1 :])


MUTATIONS = {
    _overwrite: 45,
    _absurd_count: 4,
    _magic_version: 4,
    _truncate: 10,
    _flip_header: 15,
    _random_bytes: 8,
    _insert_delete: 8,
    _append: 2,
    _data_bytes: 4,
}


def cases(data: bytes, n: int, rng: random.Random) -> list[Case]:
    pool = [m for m, weight in MUTATIONS.items() for _ in range(weight)]
    return [rng.choice(pool)(rng, data) for _ in range(n)]


# ------------------------------------------------------------------ judging


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang


def read_everything(path: Path) -> None:
    """What a conversion reads of a source: config, every tensor, and (a tokenizer-carrying file) its
    tokenizer files."""
    with open_checkpoint(path) as source:
        assert isinstance(source.config, dict)
        for name in source.keys():
            source.read(name)
            source.read_rows(name, 0, 2)
    model_files(path)


def api_outcome(path: Path) -> tuple[str, str]:
    """('ok' | 'refused' | 'bad-message' | 'traceback', detail) of reading the file, its time and
    Python allocations bounded."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    tracemalloc.start()
    try:
        read_everything(path)
        got = ("ok", "")
    except ConvertError as exc:
        got = ("refused", "") if "\n" not in str(exc) and str(exc) else ("bad-message", str(exc)[:200])
    except _Hang:
        got = ("traceback", f"no answer in {CASE_SECONDS} s")
    except Exception as exc:  # noqa: BLE001 - the point: any other exception is a finding
        got = ("traceback", f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        signal.alarm(0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > CASE_BYTES:
        return "traceback", f"allocated {peak / 2**20:.0f} MiB"
    return got


@pytest.mark.slow
def test_fuzz_gguf_through_the_reader(tmp_path, base):
    """Hundreds of mutations of a valid file, read as a conversion reads it."""
    rng = random.Random(SEED)
    tally = Tally("GGUF mutations, through the reader")
    for i, case in enumerate(cases(base, N_API, rng)):
        path = tmp_path / f"case{i % 8}.gguf"
        path.write_bytes(case.payload)
        got, detail = api_outcome(path)
        tally.record(case, got, detail, [])
    tally.report()
    tally.check(N_API)
    assert tally.total("refused") > N_API // 3 and tally.total("ok") > 20
    assert tally.counts[("data", "either", "ok")] > 0 and not tally.counts[("data", "either", "refused")]


@pytest.mark.slow
def test_fuzz_gguf_through_the_command_line(tmp_path, base):
    """A sample converted by `convert gqa2mla` (the file as `src`, found by its magic): one `error:`
    line and exit 2 with nothing on disk, or a conversion."""
    rng = random.Random(SEED + 1)
    tally = Tally("GGUF mutations, through the command line")
    work = tmp_path / "cli"
    work.mkdir()
    for case in cases(base, N_CLI, rng):
        (work / "src").write_bytes(case.payload)
        run_conversion(case, work, tally)
    tally.report()
    tally.check(N_CLI)
    assert tally.total("refused") > N_CLI // 4


def test_fields_walk_the_whole_header(tmp_path, base):
    """The walker above finds every field: the last one ends where gguf's own reader says the tensor
    infos end (before the alignment padding)."""
    (tmp_path / "base.gguf").write_bytes(base)
    last = gguf.GGUFReader(tmp_path / "base.gguf").tensors[-1].field
    assert header_end(base) == last.offset + sum(p.nbytes for p in last.parts)
