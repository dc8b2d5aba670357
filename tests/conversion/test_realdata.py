"""Tests of the real-data fixtures (fixtures/realdata.py).

The first run builds the cache (pip/apt-get downloads, a few minutes); later
runs reuse it.  The R-reader tests need no network.
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
import sys
import zlib
from pathlib import Path

import pytest

from conftest import FIXTURES

pytestmark = pytest.mark.realdata

_PATH = FIXTURES / "realdata.py"


def _load_realdata():
    name = "convert_fixtures_realdata"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


rd = _load_realdata()


# ---------------------------------------------------------------- R reader


def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _flags(sexptype: int, *, levels: int = 0, attr: bool = False, tag: bool = False) -> bytes:
    return _i(sexptype | (1 << 9 if attr else 0) | (1 << 10 if tag else 0) | (levels << 12))


def _charsxp(s: str | None, levels: int = 1 << 3) -> bytes:  # UTF8_MASK
    if s is None:
        return _flags(9) + _i(-1)
    b = s.encode("utf-8")
    return _flags(9, levels=levels) + _i(len(b)) + b


def _header(version: int = 3) -> bytes:
    h = b"X\n" + _i(version) + _i(0x040201) + _i(0x030500)
    if version == 3:
        h += _i(5) + b"UTF-8"
    return h


NILVALUE = _i(254)


def _named_strsxp() -> bytes:
    """c(a = "Emma", b = NA, c = "caf\u00e9") serialized as R would (XDR, v3)."""
    body = _flags(16, attr=True) + _i(3) + _charsxp("Emma") + _charsxp(None) + _charsxp("caf\u00e9")
    # attributes: pairlist(names = c("a", "b", "c"))
    body += _flags(2, tag=True) + _flags(1) + _charsxp("names", levels=1 << 6)
    body += _flags(16) + _i(3) + _charsxp("a") + _charsxp("b") + _charsxp("c")
    body += NILVALUE
    return body


def test_r_reader_parses_handmade_strsxp():
    obj = rd.r_unserialize(_header(3) + _named_strsxp())
    assert isinstance(obj, rd.RVector)
    assert obj.rtype == "character"
    assert list(obj) == ["Emma", None, "caf\u00e9"]
    assert list(obj.names) == ["a", "b", "c"]
    assert obj.as_dict() == {"a": "Emma", "b": None, "c": "caf\u00e9"}


def test_r_reader_version2_latin1_and_refs():
    # list(quote(sym), quote(sym), 1:2, 2.5) -- the second symbol is a REFSXP
    body = _flags(19) + _i(4)
    body += _flags(1) + _charsxp("sym")
    body += _i((1 << 8) | 255)  # REFSXP to reference-table entry 1
    body += _flags(13) + _i(2) + _i(1) + _i(2)
    body += _flags(14) + _i(1) + struct.pack(">d", 2.5)
    obj = rd.r_unserialize(_header(2) + body)
    assert obj.rtype == "list"
    assert obj[0] == "sym" and obj[1] is obj[0] and isinstance(obj[0], rd.RSymbol)
    assert list(obj[2]) == [1, 2] and obj[2].rtype == "integer"
    assert list(obj[3]) == [2.5]
    # a latin-1 CHARSXP (LATIN1_MASK) decodes to the same str
    latin = _flags(16) + _i(1) + _flags(9, levels=1 << 2) + _i(4) + "caf\u00e9".encode("latin-1")
    assert list(rd.r_unserialize(_header(2) + latin)) == ["caf\u00e9"]


def test_rds_and_lazyload_db(tmp_path):
    stream = _header(3) + _named_strsxp()
    assert list(rd.read_rds(gzip.compress(stream))) == ["Emma", None, "caf\u00e9"]

    # A one-object lazy-load DB: .rdb record = 4-byte BE length + zlib stream;
    # .rdx = gzip'd serialization of list(variables=list(x=c(0L, len)),
    # references=list(), compressed=TRUE).
    record = struct.pack(">I", len(stream)) + zlib.compress(stream)
    (tmp_path / "db.rdb").write_bytes(record)

    def named_list(items: list[tuple[str, bytes]]) -> bytes:
        out = _flags(19, attr=True) + _i(len(items)) + b"".join(v for _, v in items)
        out += _flags(2, tag=True) + _flags(1) + _charsxp("names")
        out += _flags(16) + _i(len(items)) + b"".join(_charsxp(k) for k, _ in items) + NILVALUE
        return out

    index = named_list(
        [
            ("variables", named_list([("x", _flags(13) + _i(2) + _i(0) + _i(len(record)))])),
            ("references", named_list([])),
            ("compressed", _flags(10) + _i(1) + _i(1)),
        ]
    )
    (tmp_path / "db.rdx").write_bytes(gzip.compress(_header(3) + index))
    objs = rd.read_lazyload_db(tmp_path / "db")
    assert list(objs) == ["x"]
    assert objs["x"].as_dict() == {"a": "Emma", "b": None, "c": "caf\u00e9"}


def test_r_reader_rejects_garbage():
    with pytest.raises(ValueError):
        rd.r_unserialize(b"RDX2\n" + _i(0))
    with pytest.raises(ValueError):
        rd.r_unserialize(_header(3) + _flags(16) + _i(5) + _charsxp("only one"))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVERT_FIXTURE_CACHE", str(tmp_path / "c"))
    assert rd.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CONVERT_FIXTURE_CACHE")
    assert rd.cache_dir() == Path.home() / ".cache" / "convert-fixtures"


# ---------------------------------------------------------------- texts


def test_austen_books():
    books = rd.austen_books()
    assert sorted(books) == sorted(rd.AUSTEN_BOOKS)
    emma = rd.austen_text("emma")
    assert len(emma.split()) > 100_000
    assert "Emma Woodhouse" in emma
    assert emma.startswith("EMMA")
    pp = rd.austen_text("prideprejudice")
    assert "It is a truth universally acknowledged" in pp
    for b in books:
        assert len(rd.austen_text(b).split()) > 50_000, b
    with pytest.raises(ValueError):
        rd.austen_text("ulysses")


def test_jargon_text():
    text = rd.jargon_text()
    assert len(text.split()) > 100_000
    assert "hacker" in text


def test_devil_text():
    text = rd.devil_text()
    assert len(text.split()) > 30_000
    assert "AMBROSE BIERCE" in text and "CYNIC, n." in text


# ---------------------------------------------------------------- model


@pytest.mark.slow
def test_smollm2_dir_loads_with_expected_config():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = rd.smollm2_dir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / f).is_file(), f

    cfg = transformers.AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) == 64
    rp = getattr(cfg, "rope_parameters", None) or {}
    assert rp.get("rope_theta", getattr(cfg, "rope_theta", None)) == pytest.approx(1e5)
    assert cfg.tie_word_embeddings is True
    assert getattr(cfg, "quantization_config", None) is None

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_dtype() == "F32"
        assert emb.get_shape() == [49152, 576]
    assert "model.layers.29.self_attn.q_proj.weight" in keys

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ppl, n = rd.perplexity(model, tok, rd.austen_text("emma"), window=256, max_tokens=1024)
    assert n > 1000
    assert 5 < ppl < 80, ppl


@pytest.mark.slow
def test_text_kinds_calibrate_and_judge_on_disjoint_documents(smollm2_tokenizer):
    """Issue 65's four kinds of text: each part tens of thousands of tokens, its calibration and judging
    documents disjoint; dialogue in SmolLM2's chat template (and as plain turns without one)."""
    realdata = _load_realdata()
    for kind in realdata.TEXT_KINDS:
        calib, held_out = (realdata.text_kind(kind, part, smollm2_tokenizer) for part in ("calib", "eval"))
        assert min(len(calib), len(held_out)) > 150_000, kind
        if kind != "dialogue":  # the corpus repeats turns across its conversations: split by conversation
            first_lines = lambda text: {line for line in text.splitlines()[:2000] if len(line) > 60}
            assert not first_lines(calib) & first_lines(held_out), kind  # no shared document
    dialogue = realdata.text_kind("dialogue", "eval", smollm2_tokenizer)
    calib = realdata.text_kind("dialogue", "calib", smollm2_tokenizer)
    assert dialogue.count("<|im_start|>assistant") > 500
    assert 0.4 < calib.count("<|im_start|>system") / dialogue.count("<|im_start|>system") < 0.6  # a third vs two
    plain = realdata.text_kind("dialogue", "eval")
    assert "<|im_start|>" not in plain and plain.count("\nAssistant: ") > 500
    assert "def " in realdata.text_kind("code") and ".. " in realdata.text_kind("technical")
