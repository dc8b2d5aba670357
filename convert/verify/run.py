"""What one verification run compares, and how: both checkpoints, the converted config, where and
in which precision they run, and the twin whose figures are the noise floor."""

from dataclasses import dataclass

import torch

from convert.io import Checkpoint


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

    @property
    def mla(self) -> dict:
        return self.config["mla"]

    def prefix(self, layer: int) -> str:
        return self.mla["layer_prefix"].format(i=layer)
