"""Checkpoint input/output: a validating lazy reader, an atomic sharded writer, and the rules
for which output a run may create or replace (`check_output`, `output_lock`).

Its names load on first use (PEP 562): `convert.io.output` needs no torch, so the command line
refuses an output it must not write before torch is imported."""

import importlib

_HOME = {
    "MANIFEST_NAME": "output",
    "check_output": "output",
    "default_output": "output",
    "output_lock": "output",
    "SAFETENSORS_DTYPES": "reader",
    "TORCH_TO_SAFETENSORS": "reader",
    "Checkpoint": "reader",
    "TensorEntry": "reader",
    "dtype_itemsize": "reader",
    "open_checkpoint": "reader",
    "read_header": "reader",
    "CheckpointWriter": "writer",
    "parse_size": "writer",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'convert.io' has no attribute {name!r}")
    return getattr(importlib.import_module(f"convert.io.{_HOME[name]}"), name)
