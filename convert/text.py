"""Text to token ids, for verification and calibration."""

from pathlib import Path

import torch

from convert.errors import ConvertError
from convert.hf import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


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
    """The model directory's own tokenizer, or None when it has none (e.g. a random fixture)."""
    if not any((Path(model_root) / n).is_file() for n in TOKENIZER_FILES):
        return None

    return load_tokenizer(model_root)


def calibration_ids(source, opts) -> torch.Tensor:
    """The calibration token ids (1, N ≤ --calib-tokens): given, or --calib tokenized
    (`opts`: a `ConvertOptions`; `source`: the checkpoint, whose tokenizer reads it)."""
    ids = opts.calib
    if not isinstance(ids, torch.Tensor):
        root = getattr(source, "root", Path(opts.calib).parent)
        vocab = (source.config or {})["vocab_size"]
        ids = text_token_ids(Path(opts.calib), root, vocab, opts.calib_tokens, what="--calib")
    return ids[:, : opts.calib_tokens]


def fisher_ids(ids: torch.Tensor, fisher_tokens: int | None) -> torch.Tensor:
    """What the Fisher pass reads of the calibration ids (1, N): their first `fisher_tokens` (None: all).
    The sequential streams and the refinement read all of them (docs/compression.md, "The default
    calibration")."""
    return ids[:, :fisher_tokens]
