"""Tests for convert.io: the checkpoint reader and the atomic sharded writer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert.errors import ConvertError
from convert.io import MANIFEST_NAME, CheckpointWriter, open_checkpoint
from convert.sizes import parse_size


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(4, 6, generator=g),
        "w.f64": torch.randn(7, generator=g, dtype=torch.float64),
        "w.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "i.i64": torch.arange(-5, 5, dtype=torch.int64),
        "i.i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "i.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i.u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "b.bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def _plan(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_raw_file(path: Path, header: object, data: bytes = b"", header_text: bytes | None = None) -> None:
    body = header_text if header_text is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _assert_no_leftovers(parent: Path) -> None:
    hidden = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert hidden == [], f"temporary files left behind: {hidden}"


# ------------------------------------------------------------------ reader


def test_single_file(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "k": "v"})
    with open_checkpoint(path) as ckpt:
        assert ckpt.path == path and ckpt.root == tmp_path and ckpt.files == [path]
        assert ckpt.config is None
        assert ckpt.metadata == {"format": "pt", "k": "v"}
        assert set(ckpt.keys()) == set(tensors)
        for name, t in tensors.items():
            assert name in ckpt
            assert ckpt.shape(name) == tuple(t.shape)
            assert ckpt.dtype(name) == t.dtype
            assert ckpt.nbytes(name) == t.numel() * t.element_size()
            got = ckpt.get(name)
            assert got.dtype == t.dtype and torch.equal(got, t)
            assert ckpt.raw_bytes(name) == _bytes_of(t)
        assert "nope" not in ckpt
        assert ckpt.total_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())


def test_single_file_reads_config_beside_it(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with open_checkpoint(tmp_path / "x.safetensors") as ckpt:
        assert ckpt.config == {"hidden_size": 8}
        assert ckpt.metadata == {}


def test_keys_in_file_order(tmp_path: Path) -> None:
    # Write in an order that is neither alphabetical nor the header's order.
    plan = {"z": ((4,), torch.float32), "a": ((2,), torch.float32), "m": ((3,), torch.float32)}
    with CheckpointWriter(tmp_path / "out", plan, 10**9) as w:
        for n, (shape, dtype) in plan.items():
            w.write(n, torch.ones(shape, dtype=dtype))
        out = w.commit()
    with open_checkpoint(out) as ckpt:
        assert ckpt.keys() == ["z", "a", "m"]


def test_lazy_read_rows_and_raw_bytes(tmp_path: Path) -> None:
    t = torch.arange(60, dtype=torch.float32).reshape(10, 6).to(torch.bfloat16)
    save_file({"t": t, "u": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.read_rows("t", 2, 5), t[2:5])
        assert torch.equal(ckpt.read_rows("t", 0, 10), t)
        assert ckpt.raw_bytes("t") == _bytes_of(t)
        assert ckpt.raw_bytes("u") == _bytes_of(torch.ones(2))


def test_read_into_fills_a_tensor_in_place_or_piece_by_piece(tmp_path: Path, monkeypatch) -> None:
    """`read_into` reads straight into a tensor of the stored dtype, and converts `RAW_CHUNK`
    bytes at a time into any other (whole models are filled this way, with no second copy)."""
    import convert.io.reader as reader

    t = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"t": t, "empty": torch.ones(0, 3)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(reader, "RAW_CHUNK", 16)  # 8 bfloat16 values a piece: 8 pieces, the last short
    with open_checkpoint(tmp_path) as ckpt:
        same = torch.full((10, 6), float("nan"), dtype=torch.bfloat16)
        ckpt.read_into("t", same)
        assert torch.equal(same, t)
        wide = torch.nn.Parameter(torch.full((10, 6), float("nan"), dtype=torch.float64))
        ckpt.read_into("t", wide)
        assert torch.equal(wide.detach(), t.double())
        ckpt.read_into("empty", torch.ones(0, 3))
        with pytest.raises(ValueError, match=r"\(10, 6\) into a \(6, 10\)"):
            ckpt.read_into("t", torch.zeros(6, 10))


def test_hf_dir(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    save_file({"b": torch.ones(3)}, str(tmp_path / "other.safetensors"))  # ignored: model.* wins
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with open_checkpoint(str(tmp_path)) as ckpt:
        assert ckpt.path == tmp_path and ckpt.root == tmp_path
        assert ckpt.files == [tmp_path / "model.safetensors"]
        assert ckpt.keys() == ["a"]
        assert ckpt.config == {"model_type": "llama"}
        assert ckpt.metadata == {"format": "pt"}


def test_dir_with_one_oddly_named_file(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "weights.safetensors"))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.keys() == ["a"]
        assert ckpt.config is None


def test_sharded_dir_round_trip(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.w": torch.full((10, 10), float(i)) for i in range(5)}  # 400 B each
    with CheckpointWriter(tmp_path / "out", _plan(tensors), 1000) as w:
        for n, t in tensors.items():
            w.write(n, t)
        out = w.commit()
    (out / "config.json").write_text("{}")
    with open_checkpoint(out) as ckpt:
        assert len(ckpt.files) == 3
        assert ckpt.keys() == list(tensors)
        assert ckpt.config == {}
        assert ckpt.metadata == {"format": "pt"}
        for n, t in tensors.items():
            assert torch.equal(ckpt.get(n), t)
    # The index file itself is also accepted as the path.
    with open_checkpoint(out / "model.safetensors.index.json") as ckpt:
        assert ckpt.root == out and len(ckpt.keys()) == 5


def test_get_missing_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "m.safetensors"))
    with open_checkpoint(tmp_path / "m.safetensors") as ckpt:
        with pytest.raises(ConvertError, match=r"'nope'.*m\.safetensors"):
            ckpt.get("nope")
        with pytest.raises(ConvertError, match="'nope'"):
            ckpt.shape("nope")


# ------------------------------------------------------------------ reader errors


def _err(path: Path) -> str:
    with pytest.raises(ConvertError) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert info.value.exit_code == 2
    return msg


def test_missing_path(tmp_path: Path) -> None:
    assert "ghost.safetensors" in _err(tmp_path / "ghost.safetensors")


def test_bin_file_says_convert(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    msg = _err(tmp_path / "pytorch_model.bin")
    assert "pytorch_model.bin" in msg and "safe_serialization=True" in msg
    msg = _err(tmp_path)  # directory with only a .bin
    assert "pytorch_model.bin" in msg and "safe_serialization=True" in msg


def test_not_safetensors_content(tmp_path: Path) -> None:
    path = tmp_path / "fake.safetensors"
    torch.save({"a": torch.ones(2)}, path)  # a zip file with a .safetensors name
    msg = _err(path)
    assert "fake.safetensors" in msg and "not a safetensors file" in msg
    short = tmp_path / "tiny.safetensors"
    short.write_bytes(b"abc")
    assert "tiny.safetensors" in _err(short)
    nojson = tmp_path / "nojson.safetensors"
    _write_raw_file(nojson, None, header_text=b"\x00\x01garbage!")
    assert "nojson.safetensors" in _err(nojson)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(100, 10), "b": torch.randn(50)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-123])
    msg = _err(path)
    assert "model.safetensors" in msg and "truncated" in msg
    # Chopped inside the header as well.
    path.write_bytes(data[:20])
    assert "model.safetensors" in _err(path)


def test_corrupt_header_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    _write_raw_file(path, None, b"\0" * 8, header_text=b'{"a": {"dtype": "F32", "shape": [2]')
    msg = _err(path)
    assert "bad.safetensors" in msg and "corrupt" in msg


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"shape": [2], "data_offsets": [0, 8]}, "dtype"),
        ({"dtype": "F32", "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [2]}, "data_offsets"),
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}, "Q4"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
    ],
)
def test_corrupt_header_entries(tmp_path: Path, entry: dict, needle: str) -> None:
    path = tmp_path / "ent.safetensors"
    _write_raw_file(path, {"a": entry}, b"\0" * 8)
    msg = _err(path)
    assert "ent.safetensors" in msg and "'a'" in msg and needle in msg


_ENTRY = b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


@pytest.mark.parametrize(
    "header_text, needle",
    [
        (b'{"a":' + _ENTRY + b',"a":' + _ENTRY + b"}", "'a' appears twice"),
        (b'{"__metadata__":{},"__metadata__":{"x":"y"},"a":' + _ENTRY + b"}", "'__metadata__' appears twice"),
        (b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', "'dtype' appears twice"),
        (b'{"a":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}', "dtype ['F32']"),
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[[]]}}', "nested"),
        (b'{"x":' + b"[" * 100000 + b"]" * 100000 + b',"a":' + _ENTRY + b"}", "nested"),
        (b'{"a\xff":' + _ENTRY + b"}", "UTF-8"),
        (b'{"\\ud800":' + _ENTRY + b"}", "surrogate"),
        (b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', "NaN"),
        (b'{"a":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,8]}}', "digits"),
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[false,true]}}', "data_offsets"),
    ],
)
def test_strict_header_json(tmp_path: Path, header_text: bytes, needle: str) -> None:
    """Duplicate keys, deep nesting, bad UTF-8, surrogates, NaN and huge numbers: one line, no traceback."""
    path = tmp_path / "strict.safetensors"
    _write_raw_file(path, None, b"\0" * 8, header_text=header_text)
    msg = _err(path)
    assert "strict.safetensors" in msg and needle in msg, msg


def test_unknown_entry_field_is_ignored(tmp_path: Path) -> None:
    """safetensors itself ignores fields it does not know in a tensor's entry."""
    path = tmp_path / "extra.safetensors"
    _write_raw_file(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "note": "x"}}, b"\0" * 8)
    with open_checkpoint(path) as ckpt:
        assert ckpt.shape("a") == (2,)


def test_trailing_bytes_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tail.safetensors"
    save_file({"a": torch.ones(2)}, str(path))
    path.write_bytes(path.read_bytes() + b"\0" * 16)
    assert "tail.safetensors" in _err(path)


def test_index_missing_shard(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.ones(100) for i in range(3)}
    with CheckpointWriter(tmp_path / "out", _plan(tensors), 500) as w:
        for n, t in tensors.items():
            w.write(n, t)
        out = w.commit()
    (out / "model-00002-of-00003.safetensors").unlink()
    msg = _err(out)
    assert "model-00002-of-00003.safetensors" in msg and "model.safetensors.index.json" in msg


def test_index_invalid(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "s.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    assert "model.safetensors.index.json" in _err(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in _err(tmp_path)
    index.write_text(json.dumps({"weight_map": {"ghost": "s.safetensors"}}))
    msg = _err(tmp_path)
    assert "'ghost'" in msg and "s.safetensors" in msg


def test_config_invalid(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{oops")
    assert "config.json" in _err(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "hidden_size": 16}')
    msg = _err(tmp_path)
    assert "config.json" in msg and "'hidden_size' appears twice" in msg


def test_index_shard_outside_the_directory(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "s.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    for shard in ("../s.safetensors", "/tmp/s.safetensors", "..", ""):
        index.write_text(json.dumps({"weight_map": {"a": shard}}))
        msg = _err(tmp_path)
        assert "model.safetensors.index.json" in msg and "not a file name" in msg, msg


def test_dir_without_or_with_many_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "empty" in _err(empty)
    many = tmp_path / "many"
    many.mkdir()
    save_file({"a": torch.ones(1)}, str(many / "a.safetensors"))
    save_file({"b": torch.ones(1)}, str(many / "b.safetensors"))
    msg = _err(many)
    assert "many" in msg and "index" in msg


# ------------------------------------------------------------------ writer


def test_writer_round_trip_exact(tmp_path: Path) -> None:
    tensors = _tensors()
    out_dir = tmp_path / "out"
    with CheckpointWriter(out_dir, _plan(tensors), 10**9, metadata={"source": "test"}) as w:
        for n, t in tensors.items():
            w.write(n, t)
        assert not out_dir.exists()
        out = w.commit()
    assert out == out_dir
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert set(loaded) == set(tensors)
    for n, t in tensors.items():
        assert loaded[n].dtype == t.dtype and loaded[n].shape == t.shape
        assert torch.equal(loaded[n], t), n
    with open_checkpoint(out) as ckpt:
        assert ckpt.metadata == {"format": "pt", "source": "test"}
    # Header padded to 8 bytes and each tensor aligned to its element size,
    # as safetensors itself lays files out.
    data = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    for name, t in tensors.items():
        assert header[name]["data_offsets"][0] % t.element_size() == 0, name
    _assert_no_leftovers(tmp_path)


def test_writer_accepts_views_and_noncontiguous(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "s": base[1:3], "g": torch.ones(3, requires_grad=True)}
    with CheckpointWriter(tmp_path / "o", _plan(tensors), 10**9) as w:
        for n, t in tensors.items():
            w.write(n, t)
        out = w.commit()
    loaded = load_file(str(out / "model.safetensors"))
    for n, t in tensors.items():
        assert torch.equal(loaded[n], t.detach())


def test_raw_copy_is_bit_exact(tmp_path: Path) -> None:
    # A bf16 NaN with a non-canonical payload survives only a byte copy.
    raw = torch.tensor([0x7FC1, -1, 0x0001, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    src = tmp_path / "src.safetensors"
    save_file({"x": raw, "y": torch.randn(3, 3)}, str(src))
    with (
        open_checkpoint(src) as ckpt,
        CheckpointWriter(tmp_path / "dst", {n: (ckpt.shape(n), ckpt.dtype(n)) for n in ckpt.keys()}, 10**9) as w,
    ):
        for n in ckpt.keys():
            w.write_raw(n, ckpt.raw_bytes(n))
        out = w.commit()
    with open_checkpoint(out) as a, open_checkpoint(src) as b:
        for n in b.keys():
            assert a.raw_bytes(n) == b.raw_bytes(n)


def test_sharding_split_and_index(tmp_path: Path) -> None:
    plan = {
        "a": ((100,), torch.float32),  # 400
        "b": ((100,), torch.float32),  # 400 -> 800 fits in 1000
        "c": ((100,), torch.float32),  # would be 1200 -> new shard
        "big": ((1000,), torch.float32),  # 4000 > limit -> own shard
        "d": ((50,), torch.bfloat16),  # 100 -> new shard after big
        "e": ((100,), torch.float32),  # 400 -> 500 fits
    }
    tensors = {n: torch.randn(s).to(d) for n, (s, d) in plan.items()}
    with CheckpointWriter(tmp_path / "out", plan, 1000) as w:
        for n, t in tensors.items():
            w.write(n, t)
        out = w.commit()
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(p.name for p in out.iterdir()) == sorted(names + ["model.safetensors.index.json", MANIFEST_NAME])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 400 * 3 + 4000 + 100 + 400}
    assert index["weight_map"] == {
        "a": names[0],
        "b": names[0],
        "c": names[1],
        "big": names[2],
        "d": names[3],
        "e": names[3],
    }
    for name, shard in index["weight_map"].items():
        assert torch.equal(load_file(str(out / shard))[name], tensors[name])
    for shard in names:
        expected = sum(v == shard for v in index["weight_map"].values())
        assert len(load_file(str(out / shard))) == expected


def test_out_of_order_writes(tmp_path: Path) -> None:
    dtypes = [torch.float32, torch.bfloat16]
    tensors = {f"t{i}": torch.randn(i + 1, 3).to(dtypes[i % 2]) for i in range(6)}
    with CheckpointWriter(tmp_path / "out", _plan(tensors), 60) as w:
        for n in reversed(list(tensors)):
            w.write(n, tensors[n])
        out = w.commit()
    with open_checkpoint(out) as ckpt:
        assert len(ckpt.files) > 1
        for n, t in tensors.items():
            assert torch.equal(ckpt.get(n), t)


def test_missing_tensor_at_commit(tmp_path: Path) -> None:
    plan = {"a": ((2,), torch.float32), "b": ((2,), torch.float32)}
    w = CheckpointWriter(tmp_path / "out", plan, 10**9)
    w.write("a", torch.ones(2))
    with pytest.raises(ConvertError, match="'b'"):
        w.commit()
    assert not (tmp_path / "out").exists()
    _assert_no_leftovers(tmp_path)


def test_exception_in_with_leaves_nothing(tmp_path: Path) -> None:
    plan = {"a": ((2,), torch.float32)}
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(tmp_path / "out", plan, 10**9) as w:
            w.write("a", torch.ones(2))
            assert w.tmp_dir.is_dir()
            raise RuntimeError("boom")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_exit_without_commit_leaves_nothing(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path / "out", {"a": ((1,), torch.float32)}, 10**9) as w:
        w.write("a", torch.ones(1))
    assert list(tmp_path.iterdir()) == []


def _earlier_output(out: Path) -> None:
    """A directory convert wrote: it has a manifest listing every file."""
    with CheckpointWriter(out, {"a": ((1,), torch.float32)}, 10**9) as w:
        w.write("a", torch.zeros(1))
        w.write_text("old.txt", "old")
        w.commit()


def test_existing_output_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _earlier_output(out)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConvertError, match=r"out exists \(an earlier conversion\); pass force=True"):
        CheckpointWriter(out, {"a": ((1,), torch.float32)}, 10**9)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_existing_output_with_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _earlier_output(out)
    with CheckpointWriter(out, {"a": ((1,), torch.float32)}, 10**9, force=True) as w:
        w.write("a", torch.ones(1))
        assert (out / "old.txt").exists()  # old output untouched until commit
        w.commit()
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["a"], torch.ones(1))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_never_replaces_what_convert_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match=r"out has no \.convert-manifest\.json"):
        CheckpointWriter(out, {"a": ((1,), torch.float32)}, 10**9, force=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_write_mismatch_errors(tmp_path: Path) -> None:
    plan = {"a": ((2, 3), torch.bfloat16)}
    with CheckpointWriter(tmp_path / "out", plan, 10**9) as w:
        with pytest.raises(ConvertError, match="'a'.*shape"):
            w.write("a", torch.ones(3, 2, dtype=torch.bfloat16))
        with pytest.raises(ConvertError, match="'a'"):
            w.write("a", torch.ones(2, 3))  # float32, plan says bf16
        with pytest.raises(ConvertError, match="'a'.*11 bytes"):
            w.write_raw("a", b"\0" * 11)
        with pytest.raises(ConvertError, match="'zzz'"):
            w.write("zzz", torch.ones(1))
        w.write("a", torch.ones(2, 3, dtype=torch.bfloat16))
        with pytest.raises(ConvertError, match="'a' written twice"):
            w.write("a", torch.ones(2, 3, dtype=torch.bfloat16))
    assert list(tmp_path.iterdir()) == []


def test_extra_files_and_tmp_dir(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path / "out", {"a": ((1,), torch.float32)}, 10**9) as w:
        w.write("a", torch.ones(1))
        w.write_json("config.json", {"hidden_size": 4})
        w.write_text("README.md", "hi\n")
        w.write_file("plot.png", b"\x89PNG\r\n")
        assert json.loads((w.tmp_dir / "config.json").read_text()) == {"hidden_size": 4}
        w.flush()  # the writer thread has written what it was handed
        with open_checkpoint(w.tmp_dir) as ckpt:  # readable before commit
            assert torch.equal(ckpt.get("a"), torch.ones(1))
            assert ckpt.config == {"hidden_size": 4}
        with pytest.raises(ConvertError, match="model.safetensors"):
            w.write_file("model.safetensors", b"")
        with pytest.raises(ConvertError):
            w.write_text("../escape.txt", "x")
        out = w.commit()
    assert (out / "README.md").read_text() == "hi\n"
    assert (out / "plot.png").read_bytes() == b"\x89PNG\r\n"
    assert not (tmp_path / "escape.txt").exists()
    with pytest.raises(ConvertError):
        w.write("a", torch.ones(1))


def test_writer_output_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: transformers saves only the embedding
    with CheckpointWriter(tmp_path / "m", _plan(state), 2000) as w:
        for n in reversed(list(state)):
            w.write(n, state[n])
        w.write_json("config.json", config.to_dict())
        out = w.commit()
    assert (out / "model.safetensors.index.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# ------------------------------------------------------------------ parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1000", 1000),
        ("1.5GB", 1_500_000_000),
        ("10kb", 10_000),
        (" 3 MiB ", 3 * 2**20),
        ("7B", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "5XB", "-5GB", "GB", "0", "1.2.3GB"])
def test_parse_size_errors(text: str) -> None:
    with pytest.raises(ConvertError, match="max_shard_size"):
        parse_size(text)


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "buffered"])
def test_copy_span_copies_stored_bytes_file_to_file(tmp_path: Path, monkeypatch, kernel_copy: bool) -> None:
    """A tensor copied through (`copy_span`) lands byte for byte, by copy_file_range or, where the
    file systems refuse it, through a buffer; a source that ends early is an error, not zeros."""
    import errno
    import os

    src = tmp_path / "src.safetensors"
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    save_file(tensors, src)
    if not kernel_copy:

        def refuse(*args):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

        monkeypatch.setattr(os, "copy_file_range", refuse)
    plan = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    with open_checkpoint(src) as ckpt, CheckpointWriter(tmp_path / "out", plan, 10**9) as w:
        for name in tensors:
            w.copy_span(name, *ckpt.raw_span(name))
        out = w.commit()
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    with open_checkpoint(src) as ckpt, CheckpointWriter(tmp_path / "short", plan, 10**9) as w:
        path, offset, nbytes = ckpt.raw_span("a")
        w.copy_span("a", path, src.stat().st_size - 100, nbytes)  # runs past the end of the file
        with pytest.raises(ConvertError, match="bytes missing"):
            w.flush()


def test_a_checkpoint_is_read_from_several_threads(tmp_path: Path, monkeypatch) -> None:
    """Layers are converted two at a time, each thread reading its tensors: the checkpoint opens
    one handle per file whatever the threads do (two handles, one dropped, once closed the other's
    descriptor under its read: 'Bad file descriptor', exit 3). A slow open widens the race."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import convert.io.reader as reader_module

    opened = []

    def slow_open(*args, **kwargs):
        opened.append(args[0])
        time.sleep(0.02)
        return open(*args, **kwargs)

    monkeypatch.setattr(reader_module, "open", slow_open, raising=False)
    tensors = {f"t{i}": torch.full((64, 64), float(i)) for i in range(16)}
    save_file(tensors, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt, ThreadPoolExecutor(8) as pool:
        before = len(opened)  # the header's read
        got = dict(zip(tensors, pool.map(ckpt.read, tensors)))
    assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    assert len(opened) - before == 1, opened
