"""Healing data: documents from text, JSONL or Parquet files (local files, read through `datasets`
as a stream), tokenized, packed into windows, and put in one seeded order that every process
agrees on: sample k of the run is the same window on 1 or N processes, and a process takes the
samples of its share of each global batch (`rank_samples`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from datasets import load_dataset

from convert.errors import ConvertError
from convert.text import model_tokenizer

#: File suffix -> the `datasets` builder that reads it (one document per file for text).
BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def documents(paths, text_field: str = "text") -> Iterator[str]:
    """The documents of `paths`, in order, streamed: a text file is one document; a JSONL or Parquet
    file one per row (its `text_field` column). Nothing is loaded whole or cached."""
    for path in map(Path, paths):
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConvertError(f"--text {path}: unknown kind of file; give .txt/.md (UTF-8), .jsonl/.json or .parquet")
        if not path.is_file():
            raise ConvertError(f"--text {path}: no such file; give a UTF-8 text, JSONL or Parquet file")
        extra = {"sample_by": "document", "encoding_errors": "replace"} if builder == "text" else {}
        rows = load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **extra)
        field = "text" if builder == "text" else text_field
        for row in rows:
            if field not in row:
                raise ConvertError(
                    f"--text {path}: no field {field!r} in its rows (fields: {', '.join(sorted(row))}); "
                    "name the text's field with --text-field"
                )
            text = row[field]
            if text:
                yield str(text)


def tokenizer_of(model_root: Path | None, vocab_size: int) -> Callable[[str], list[int]]:
    """Text -> token ids, end-of-sequence appended: the model directory's own tokenizer, or for a
    checkpoint without one (a random fixture) its UTF-8 bytes mod `vocab_size`."""
    tokenizer = None if model_root is None else model_tokenizer(model_root)
    if tokenizer is None:
        return lambda text: [b % vocab_size for b in text.encode("utf-8")]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return lambda text: list(tokenizer(text)["input_ids"]) + eos


def token_stream(paths, tokenize, text_field: str = "text") -> Iterator[int]:
    """The token ids of every document of `paths`, one after the other."""
    for document in documents(paths, text_field):
        yield from tokenize(document)


def read_tokens(paths, tokenize, n_tokens: int, what: str, text_field: str = "text") -> torch.Tensor:
    """The first `n_tokens` token ids (1, N) of `paths`' documents (reading stops there)."""
    ids = []
    for token in token_stream(paths, tokenize, text_field):
        ids.append(token)
        if len(ids) == n_tokens:
            break
    if len(ids) < 2:
        raise ConvertError(f"{what}: fewer than 2 tokens; give a longer text")
    return torch.tensor(ids)[None]


def rank_samples(step: int, global_batch: int, rank: int, world: int) -> range:
    """The samples (global indices) process `rank` of `world` trains on at `step`: its contiguous
    share of the step's `global_batch` samples, so that the union over processes is the step's batch."""
    share = global_batch // world
    start = step * global_batch + rank * share
    return range(start, start + share)


class WindowsInMemory:
    """Non-overlapping windows (n, window) of token ids (1, N) (a text shorter than a window is one
    window), visited in a seeded order: epoch e (samples e·n … e·n+n-1) is a permutation of the
    windows drawn from seed and e."""

    def __init__(self, ids: torch.Tensor, window: int, seed: int) -> None:
        window = min(window, ids.shape[-1])
        n = ids.shape[-1] // window
        self.windows = ids[0, : n * window].reshape(n, window)  # (n, window)
        self.window, self.seed = window, seed
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.windows.shape[0]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self), generator=generator)}
        return self._orders[epoch]

    def batch(self, samples: range) -> torch.Tensor:
        """The windows (len(samples), window) of these global sample indices."""
        rows = [int(self._order(k // len(self))[k % len(self)]) for k in samples]
        return self.windows[rows]


class WindowsStreamed:
    """Windows packed from a token stream read from the files again at every epoch (for corpora
    larger than memory), through a seeded shuffle buffer: samples must be asked for in increasing
    order (a resumed run reads the stream up to its position again). The first `held_out`
    windows of the stream are never trained on (`held_out_ids`)."""

    def __init__(self, stream: Callable[[], Iterator[int]], window: int, seed: int, held_out: int, buffer: int = 1024):
        self.stream, self.window, self.seed, self.buffer = stream, window, seed, buffer
        self.held_out = held_out
        self._position, self._iterator = 0, None

    def held_out_ids(self) -> torch.Tensor:
        """The held-out windows' token ids (1, held_out·window)."""
        windows = self._windows(self.stream())
        head = [next(windows, None) for _ in range(self.held_out)]
        if any(w is None for w in head) or not head:
            raise ConvertError("--text: too short to hold out check windows; give a longer text or --check-every 0")
        return torch.cat(head)[None]

    def _windows(self, tokens: Iterator[int]) -> Iterator[torch.Tensor]:
        chunk = []
        for token in tokens:
            chunk.append(token)
            if len(chunk) == self.window:
                yield torch.tensor(chunk)
                chunk = []

    def _epoch(self, epoch: int) -> Iterator[torch.Tensor]:
        windows = self._windows(self.stream())
        for _ in range(self.held_out):
            next(windows, None)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        pool, count = [], 0
        for window in windows:
            pool.append(window)
            count += 1
            if len(pool) == self.buffer:
                yield pool.pop(int(torch.randint(len(pool), (), generator=generator)))
        while pool:
            yield pool.pop(int(torch.randint(len(pool), (), generator=generator)))
        if count == 0:
            raise ConvertError("--text: no full --window of training tokens after the held-out ones; give more text")

    def _all(self) -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            yield from self._epoch(epoch)
            epoch += 1

    def batch(self, samples: range) -> torch.Tensor:
        """The windows (len(samples), window) of these global sample indices (increasing)."""
        if self._iterator is None or samples.start < self._position:
            self._iterator, self._position = self._all(), 0
        for _ in range(samples.start - self._position):
            next(self._iterator)
        rows = [next(self._iterator) for _ in samples]
        self._position = samples.stop
        return torch.stack(rows)  # (len(samples), window)
