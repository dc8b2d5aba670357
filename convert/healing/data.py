"""Healing data: documents from text, JSONL or Parquet files (local files, read through `datasets`
as a stream), tokenized, packed into windows, and put in one seeded order that every process
agrees on: sample k of the run is the same window on 1 or N processes, and a process takes the
samples of its share of each global batch (`rank_samples`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import torch

from convert.errors import ConvertError
from convert.text import documents, read_tokens, token_stream, tokenizer_of

__all__ = [
    "WindowsInMemory",
    "WindowsStreamed",
    "documents",
    "rank_samples",
    "read_tokens",
    "token_stream",
    "tokenizer_of",
]


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
        self._position = 0
        self._iterator: Iterator[torch.Tensor] | None = None

    def held_out_ids(self) -> torch.Tensor:
        """The held-out windows' token ids (1, held_out·window)."""
        windows = self._windows(self.stream())
        head = [next(windows, None) for _ in range(self.held_out)]
        if any(w is None for w in head) or not head:
            raise ConvertError("--text: too short to hold out check windows; give a longer text or --check-every 0")
        return torch.cat(cast("list[torch.Tensor]", head))[None]  # no None: checked above

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
