"""Text to token ids, for verification, calibration and healing: the user's files (UTF-8 text,
JSONL or Parquet) or the shipped text (`convert.corpus`), in the model's own tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from convert.corpus import KINDS, kind_documents, shipped_kind
from convert.errors import ConvertError
from convert.hf import load_tokenizer
from convert.io import gguf_tokenizer, is_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
#: File suffix -> the `datasets` builder that reads it (one document per file for text).
BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: Tokens per calibration window: the Fisher pass, the sequential calibration and the refinement
#: read the calibration ids in windows of this many, so a mix of texts alternates at this step.
CALIB_WINDOW = 1024


def text_token_ids(
    text_path: Path, model_root: Path, vocab_size: int, n_tokens: int, what: str = "--text"
) -> torch.Tensor:
    """The first `n_tokens` token ids (1, N) of a UTF-8 text file.

    Uses the model's own tokenizer when its directory has one; a checkpoint
    without a tokenizer (e.g. a random fixture) gets UTF-8 bytes mod vocab_size.
    """
    if not Path(text_path).is_file():
        raise ConvertError(f"{what} {text_path}: no such file; give a UTF-8 text file")
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    tokenizer = model_tokenizer(model_root)
    if tokenizer is not None:
        ids = tokenizer(text)["input_ids"]
    else:
        ids = [b % vocab_size for b in text.encode("utf-8")]
    if len(ids) < 2:
        raise ConvertError(f"{what} {text_path}: fewer than 2 tokens; give a longer text")
    return torch.tensor(ids[:n_tokens])[None]


def model_tokenizer(model_root: Path):
    """The model directory's own tokenizer, or the one a GGUF file carries (its `root` is the file);
    None when it has none (e.g. a random fixture)."""
    if is_gguf(model_root):
        return gguf_tokenizer(model_root)
    if not any((Path(model_root) / n).is_file() for n in TOKENIZER_FILES):
        return None

    return load_tokenizer(model_root)


# ---------------------------------------------------------------- documents of files


def documents(paths, text_field: str = "text", what: str = "--text") -> Iterator[str]:
    """The documents of `paths`, in order, streamed: a text file is one document; a JSONL or Parquet
    file one per row (its `text_field` column), read through `datasets` as a stream. Nothing is
    loaded whole or cached. `what`: the flag the paths came from, for messages."""
    for path in map(Path, paths):
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConvertError(f"{what} {path}: unknown kind of file; give .txt/.md (UTF-8), .jsonl/.json or .parquet")
        if not path.is_file():
            raise ConvertError(f"{what} {path}: no such file; give a UTF-8 text, JSONL or Parquet file")
        if builder == "text":
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                yield text
            continue
        from datasets import load_dataset  # heavy: only for JSONL and Parquet

        for row in load_dataset(builder, data_files=[str(path)], split="train", streaming=True):
            if text_field not in row:
                raise ConvertError(
                    f"{what} {path}: no field {text_field!r} in its rows (fields: {', '.join(sorted(row))}); "
                    "name the text's field with --text-field"
                )
            if row[text_field]:
                yield str(row[text_field])


def tokenizer_of(model_root: Path | None, vocab_size: int) -> Callable[[str], list[int]]:
    """Text -> token ids, end-of-sequence appended: the model directory's own tokenizer, or for a
    checkpoint without one (a random fixture) its UTF-8 bytes mod `vocab_size`."""
    tokenizer = None if model_root is None else model_tokenizer(model_root)
    if tokenizer is None:
        return lambda text: [b % vocab_size for b in text.encode("utf-8")]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return lambda text: list(tokenizer(text)["input_ids"]) + eos


def token_stream(paths, tokenize, text_field: str = "text", what: str = "--text") -> Iterator[int]:
    """The token ids of every document of `paths`, one after the other."""
    for document in documents(paths, text_field, what):
        yield from tokenize(document)


def read_tokens(paths, tokenize, n_tokens: int, what: str, text_field: str = "text") -> torch.Tensor:
    """The first `n_tokens` token ids (1, N) of `paths`' documents (reading stops there)."""
    ids = []
    for token in token_stream(paths, tokenize, text_field, what.split(" ")[0]):
        ids.append(token)
        if len(ids) == n_tokens:
            break
    if len(ids) < 2:
        raise ConvertError(f"{what}: fewer than 2 tokens; give a longer text")
    return torch.tensor(ids)[None]


# ---------------------------------------------------------------- calibration text


def calibration_parts(calib) -> list[Path | str]:
    """--calib as its parts: None -> every kind of the shipped text; each path given -> that file,
    or the shipped kind of that name (fiction, technical, code, dialogue) when no such file exists."""
    if calib is None:
        return list(KINDS)
    paths = [calib] if isinstance(calib, (str, Path)) else list(calib)
    return [shipped_kind(p) or Path(p) for p in paths]


def calibration_ids(source, opts) -> torch.Tensor:
    """The calibration token ids (1, N ≤ --calib-tokens): given (the API's tensor), or the text of
    --calib's parts (`calibration_parts`; the shipped mix when not given) tokenized with the
    checkpoint's tokenizer and taken a window (`CALIB_WINDOW` tokens) of each part in turn, so that
    every part is in the first windows the Fisher pass reads and each has an equal share.
    `opts`: a `ConvertOptions`; `source`: the checkpoint."""
    if isinstance(opts.calib, torch.Tensor):
        return opts.calib[:, : opts.calib_tokens]
    root = getattr(source, "root", None)
    if root is None:  # a model in memory: its tokenizer is not here, and bytes would be noise to a real model
        raise ConvertError(
            "--calib: a model in memory comes without its tokenizer, so no text can be read for it; pass --calib "
            "as token ids (1, N) of real text from its tokenizer, or --method svd"
        )
    vocab = (source.config or {})["vocab_size"]
    tokenize, tokenizer = tokenizer_of(root, vocab), model_tokenizer(root)
    streams = []
    for part in calibration_parts(opts.calib):
        if isinstance(part, str):
            streams.append(_kind_stream(part, "calib", tokenizer, tokenize))
        else:
            streams.append(token_stream([part], tokenize, what="--calib"))
    ids = interleaved_windows(streams, opts.calib_tokens, CALIB_WINDOW)
    if ids.shape[-1] < 2:
        raise ConvertError("--calib: fewer than 2 tokens; give a longer text")
    return ids


def interleaved_windows(streams: Iterable[Iterator[int]], n_tokens: int, window: int) -> torch.Tensor:
    """Up to `n_tokens` token ids (1, N): a window of each stream in turn (a stream that runs out
    leaves its turns to the others), so each stream has an equal share of the first windows."""
    streams, taken, ids = [iter(s) for s in streams], 0, []
    while streams and taken < n_tokens:
        for stream in list(streams):
            chunk = [t for _, t in zip(range(min(window, n_tokens - taken)), stream)]
            if len(chunk) < min(window, n_tokens - taken):
                streams.remove(stream)
            ids.extend(chunk)
            taken += len(chunk)
            if taken >= n_tokens:
                break
    return torch.tensor(ids, dtype=torch.long)[None]


def scored_windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """`ids` (1, N) cut into non-overlapping windows (1, ≤window) to score a model on (perplexity, KL): the
    tail is kept, but a last window of one token, which predicts nothing, is dropped."""
    chunks = (ids[:, start : start + window] for start in range(0, ids.shape[-1], window))  # each (1, ≤window)
    return [chunk for chunk in chunks if chunk.shape[-1] > 1]


def batched_windows(ids: torch.Tensor, window: int) -> torch.Tensor:
    """`ids` (1, N) as (N // window, window) rows to fit statistics on in batches (the calibration): the tail
    that does not fill a row is dropped, so that every row is a full window."""
    n = ids.shape[-1] // window * window
    return ids[0, :n].reshape(-1, window)


def fisher_ids(ids: torch.Tensor, fisher_tokens: int | None) -> torch.Tensor:
    """What the Fisher pass reads of the calibration ids (1, N): their first `fisher_tokens` (None: all).
    The sequential streams and the refinement read all of them (docs/compression.md, "The default
    calibration")."""
    return ids[:, :fisher_tokens]


# ---------------------------------------------------------------- judging text


def judging_ids(model_root: Path | None, vocab_size: int, n_tokens: int) -> dict[str, torch.Tensor]:
    """The shipped held-out text of every kind, its first `n_tokens` token ids (1, N) each, in the
    model's tokenizer (dialogue in its chat template): what a lossy conversion is judged on."""
    tokenize = tokenizer_of(model_root, vocab_size)
    tokenizer = None if model_root is None else model_tokenizer(model_root)
    judged = {}
    for kind in KINDS:
        stream = _kind_stream(kind, "held_out", tokenizer, tokenize)
        judged[kind] = torch.tensor([t for _, t in zip(range(n_tokens), stream)], dtype=torch.long)[None]
    return judged


def _kind_stream(kind: str, part: str, tokenizer, tokenize) -> Iterator[int]:
    """The token ids of the shipped text of one kind, `part` ("calib" or "held_out"), document by document."""
    return (t for doc in kind_documents(kind, part, tokenizer) for t in tokenize(doc))
