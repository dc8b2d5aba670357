"""Checkpoint input/output: a validating lazy reader and an atomic sharded writer."""

from convert.io.reader import (
    SAFETENSORS_DTYPES,
    TORCH_TO_SAFETENSORS,
    Checkpoint,
    TensorEntry,
    dtype_itemsize,
    open_checkpoint,
    read_header,
)
from convert.io.writer import CheckpointWriter, parse_size

__all__ = [
    "SAFETENSORS_DTYPES",
    "TORCH_TO_SAFETENSORS",
    "Checkpoint",
    "CheckpointWriter",
    "TensorEntry",
    "dtype_itemsize",
    "open_checkpoint",
    "parse_size",
    "read_header",
]
