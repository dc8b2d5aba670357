"""Healing data: text, JSONL and Parquet files read through `datasets`, packed into windows, in one
seeded order whatever the number of processes."""

import json
import shutil

import pytest
import torch

import convert
from convert.healing.data import WindowsInMemory, WindowsStreamed, documents, rank_samples, read_tokens

from conftest import TINY_LLAMA

DOCS = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich.", "Call me Ishmael."]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture
def corpus(tmp_path):
    """The same three documents as three text files, one JSONL file and one Parquet file."""
    pd = pytest.importorskip("pandas")
    texts = []
    for i, doc in enumerate(DOCS):
        texts.append(tmp_path / f"doc{i}.txt")
        texts[-1].write_text(doc)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": doc}) + "\n" for i, doc in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pd.DataFrame({"body": DOCS}).to_parquet(parquet)
    return texts, jsonl, parquet


def test_text_jsonl_and_parquet_give_the_same_documents_and_tokens(corpus):
    texts, jsonl, parquet = corpus
    assert list(documents(texts)) == DOCS
    assert list(documents([jsonl], "body")) == DOCS
    assert list(documents([parquet], "body")) == DOCS
    ids = [read_tokens(p, _bytes, 1000, "--text", "body") for p in (texts, [jsonl], [parquet])]
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[0], ids[2])
    assert ids[0].tolist()[0] == _bytes("".join(DOCS))


def test_reading_stops_at_the_tokens_asked_for(corpus):
    texts, _, _ = corpus
    assert read_tokens(texts, _bytes, 10, "--text").tolist() == [_bytes(DOCS[0])[:10]]


def test_a_missing_field_and_an_unknown_kind_of_file_are_refused_with_the_fix(corpus, tmp_path):
    _, jsonl, parquet = corpus
    for path in (jsonl, parquet):
        with pytest.raises(convert.ConvertError, match=rf"{path.name}: no field 'text'.*text_field"):
            list(documents([path]))
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(convert.ConvertError, match=r"notes.csv: unknown kind of file; give \.txt"):
        list(documents([tmp_path / "notes.csv"]))
    with pytest.raises(convert.ConvertError, match="no such file"):
        list(documents([tmp_path / "absent.jsonl"]))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_processes_share_each_global_batch_exactly(world):
    global_batch = 8
    for step in range(3):
        shares = [rank_samples(step, global_batch, rank, world) for rank in range(world)]
        assert sorted(k for share in shares for k in share) == list(range(step * 8, step * 8 + 8))


def test_windows_in_memory_visit_every_window_once_per_epoch_in_a_seeded_order():
    ids = torch.arange(100)[None]  # (1, 100): 12 windows of 8, 4 tokens left over
    windows = WindowsInMemory(ids, 8, seed=3)
    epoch = windows.batch(range(0, 12))  # (12, 8)
    assert sorted(int(w[0]) // 8 for w in epoch) == list(range(12))
    assert torch.equal(epoch, WindowsInMemory(ids, 8, seed=3).batch(range(0, 12)))
    assert not torch.equal(epoch, windows.batch(range(12, 24)))  # another epoch, another order
    assert not torch.equal(epoch, WindowsInMemory(ids, 8, seed=4).batch(range(0, 12)))
    split = torch.cat([windows.batch(range(0, 5)), windows.batch(range(5, 12))])
    assert torch.equal(split, epoch)


def test_streamed_windows_are_the_same_in_any_chunks_and_never_the_held_out_ones():
    def stream():
        return iter(range(8 * 50))  # 50 windows of 8 distinct tokens

    first = WindowsStreamed(stream, 8, seed=1, held_out=2, buffer=16)
    all_at_once = first.batch(range(0, 96))  # two epochs of 48
    assert torch.equal(first.held_out_ids(), torch.arange(16)[None])
    assert sorted(int(w[0]) // 8 for w in all_at_once[:48]) == list(range(2, 50))
    second = WindowsStreamed(stream, 8, seed=1, held_out=2, buffer=16)
    resumed = torch.cat([second.batch(range(0, 30)), second.batch(range(30, 31)), second.batch(range(40, 96))])
    assert torch.equal(resumed[:31], all_at_once[:31]) and torch.equal(resumed[31:], all_at_once[40:])
    other_rank = WindowsStreamed(stream, 8, seed=1, held_out=2, buffer=16)
    assert torch.equal(other_rank.batch(range(50, 60)), all_at_once[50:60])  # skipping reads the same stream


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "parquet-streaming"])
def test_cli_heals_on_jsonl_and_parquet(kind, corpus, tmp_path):
    from click.testing import CliRunner

    from convert.cli import main

    _, jsonl, parquet = corpus
    src = tmp_path / "src"
    shutil.copytree(TINY_LLAMA, src)
    convert.gqa2mla(src, tmp_path / "mla", kv_cache_ratio=0.5, method="svd", verify=False, progress=False)
    held = tmp_path / "held.txt"
    held.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 4)
    data = ["--text", jsonl] if kind == "jsonl" else ["--text", parquet, "--streaming"]
    args = ["heal", tmp_path / "mla", "--original", src, *data, "--text-field", "body", "--eval-text", held]
    args += ["--steps", "3", "--window", "16", "--check-every", "0", "--log-with", "none", "-o", tmp_path / "out"]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "healing.json").read_text())
    assert report["steps"] == 3 and len(report["history"]) == 3
    assert report["train_tokens"] == (None if kind != "jsonl" else len(_bytes("".join(DOCS))))
