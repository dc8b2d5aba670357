"""An export whose weights are one file of another format (the llamacpp target's GGUF, named by
config.json's `convert_export.file`), opened as the export checks read a checkpoint: its config and
files, and no safetensors tensors (the target's `load` reads the file)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path

from convert.io import open_checkpoint


class ForeignExport:
    """The directory `root` whose weights are `config["convert_export"]["file"]`: `path`, `root`,
    `config`, `files` and an empty `keys()`, as `convert.io.reader.Checkpoint` has them."""

    def __init__(self, root: Path, config: dict, file: str):
        self.path = self.root = root
        self.config = config
        self.files = [root / file]

    def keys(self) -> list[str]:
        return []

    def __enter__(self) -> ForeignExport:
        return self

    def __exit__(self, *exc) -> None:
        return None


def open_export(exported) -> AbstractContextManager:
    """The export at `exported` as a checkpoint: its safetensors, or (no safetensors beside it) the
    weights file its config.json's `convert_export.file` names, config.json read once."""
    directory = Path(exported)
    try:
        config = json.loads((directory / "config.json").read_text())
        file = config["convert_export"]["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return open_checkpoint(exported)
    foreign = isinstance(file, str) and "/" not in file and (directory / file).is_file()
    if not foreign or any(directory.glob("*.safetensors")):
        return open_checkpoint(exported)
    return ForeignExport(directory, config, file)
