"""What one verification run compares, and how: both checkpoints, the converted config, where and
in which precision they run, and the twin whose figures are the noise floor."""

from dataclasses import dataclass

import torch

from convert.io import Checkpoint
from convert.mla.config import MLASection


@dataclass(frozen=True)
class VerifyRun:
    """The pair under verification and how it runs (the per-layer check, end to end, streamed)."""

    original: Checkpoint
    converted: Checkpoint
    config: dict  # the converted config.json (source config + `mla`); an export's: the original's
    device: torch.device
    dtype: torch.dtype  # the run's (`--dtype auto` resolved)
    twin: Checkpoint | None = None  # the original's equivalent twin (`convert.verify.twin`): the noise floor
    ckpt_dtype: torch.dtype | None = None  # the converted checkpoint's: KV-cache bytes are counted in it
    mla: MLASection | None = None  # the converted config's section, parsed (None: an export's run)

    def __post_init__(self) -> None:
        if self.mla is None and "mla" in self.config:  # built by hand (tests): parsed here
            object.__setattr__(self, "mla", MLASection.parse(self.config["mla"], "config.json"))

    def prefix(self, layer: int) -> str:
        assert self.mla is not None  # asked of a native run only: an export's layers are not read by prefix
        return self.mla.prefix(layer)
