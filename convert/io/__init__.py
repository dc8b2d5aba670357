"""Checkpoint input/output: a validating lazy reader, an atomic sharded writer, and the rules
for which output a run may create or replace (`check_output`, `output_lock`)."""

from convert.io.output import MANIFEST_NAME, check_output, output_lock
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
    "MANIFEST_NAME",
    "SAFETENSORS_DTYPES",
    "TORCH_TO_SAFETENSORS",
    "Checkpoint",
    "CheckpointWriter",
    "TensorEntry",
    "check_output",
    "dtype_itemsize",
    "open_checkpoint",
    "output_lock",
    "parse_size",
    "read_header",
]
