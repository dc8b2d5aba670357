"""Checkpoint input/output: a validating lazy reader (safetensors, or a GGUF file of llama.cpp's), the
`TensorSource` verbs every source of tensors answers, an atomic sharded writer, and which output a run
may create or replace (`output_lock`).

Its names load on first use (PEP 562): `convert.io.output` needs no torch, so the command line
refuses an output it must not write before torch is imported."""

import importlib

_HOME = {
    "MANIFEST_NAME": "output",
    "check_output": "output",
    "default_output": "output",
    "output_lock": "output",
    "SAFETENSORS_DTYPES": "header",
    "TORCH_TO_SAFETENSORS": "header",
    "TensorEntry": "header",
    "dtype_itemsize": "header",
    "read_header": "header",
    "Checkpoint": "reader",
    "open_checkpoint": "reader",
    "model_files": "reader",
    "GGUFCheckpoint": "gguf",
    "gguf_tokenizer": "gguf",
    "is_gguf": "gguf_header",
    "TensorSource": "tensor_source",
    "CheckpointWriter": "writer",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'convert.io' has no attribute {name!r}")
    return getattr(importlib.import_module(f"convert.io.{_HOME[name]}"), name)
