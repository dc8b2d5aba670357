"""Load a converted checkpoint as a runnable transformers causal LM.

The source architecture's model with every attention module swapped for `MLAAttention`, its weights given storage
directly on the target device and filled with the converted tensors strictly, each read once.
"""

import json
from pathlib import Path
from typing import cast

import torch

from convert.arch import ARCHS
from convert.errors import ConvertError
from convert.hf import allocate, fill_strict, load_strict
from convert.io import open_checkpoint
from convert.io.reader import dtype_itemsize
from convert.mla.causal_lm import MLAForCausalLM
from convert.mla.causal_lm import swap_attention as swap_attention  # re-exported: it lives beside MLAForCausalLM
from convert.mla.config import MLASection
from convert.mla.schema import check_converted
from convert.options import TORCH_DTYPES, as_path


def read_mla_config(path) -> tuple[dict, MLASection]:
    """config.json of a converted directory, and its `mla` section parsed and checked (against the
    config and the tensors); ConvertError if it has no `mla` section."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{path} has no config.json; point at a directory written by `convert gqa2mla`")
    mla = check_converted(path)
    if mla is None:
        raise ConvertError(
            f"{config_path} has no `mla` section; it is not a converted checkpoint (run `convert gqa2mla` first)"
        )
    return json.loads(config_path.read_text()), mla


def _resolve_dtype(dtype, config: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in TORCH_DTYPES:
        raise ConvertError(f"dtype {name!r} is not one of {', '.join(TORCH_DTYPES)}; pass one of them or a torch dtype")
    return TORCH_DTYPES[name]


def _resolve_device(device) -> torch.device:
    """The device to load onto (default CPU); ConvertError, saying what to pass, where torch cannot use it."""
    try:
        device = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as err:
        raise ConvertError(f"device {device!r} is not a torch device ({err}); pass 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConvertError(
            f"device={str(device)!r}: CUDA is not available here (torch built without CUDA or no GPU visible); "
            "pass device='cpu'"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConvertError(
            f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) here; pass device='cuda:0'"
        )
    return device


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [path / "model.safetensors"]


def build_mla_model(config: dict, state: dict, dtype: torch.dtype = torch.float32, device="cpu"):
    """An MLA causal LM from a converted config (with `mla`) and state dict, in memory."""
    model = _empty_mla_model(config, dtype, device)
    load_strict(model, state, "converted weights")
    return model.eval()


def _empty_mla_model(config: dict, dtype: torch.dtype, device="cpu") -> MLAForCausalLM:
    """The converted model, its weights allocated on `device`, not initialised (nor loaded)."""
    mla = config["mla"]
    arch = ARCHS.get(mla["source_architecture"])
    if arch is None or arch.hf_attention is None:
        raise ConvertError(
            f"source architecture {mla['source_architecture']!r} has no runnable transformers model; "
            "use `convert verify` for per-layer checks"
        )
    return cast(MLAForCausalLM, allocate(MLAForCausalLM.from_converted_config(config, dtype), device))  # the same model


def load_mla_model(path, device=None, dtype=None):
    """Build the source architecture's causal LM with MLA attention and load the weights.

    path: a directory written by `convert gqa2mla`. device: torch device (default
    CPU), where the weights are allocated and read into (no copy elsewhere first).
    dtype: torch dtype or name (default: the checkpoint's). Returns the
    `MLAForCausalLM` that `AutoModelForCausalLM.from_pretrained(path)` returns:
    `model(input_ids).logits` and `model.generate(...)`; the KV cache holds
    latents only.
    """
    path = as_path("path", path)
    config, _ = read_mla_config(path)
    device, dtype = _resolve_device(device), _resolve_dtype(dtype, config)
    try:
        model = _empty_mla_model(config, dtype, device)
    except ConvertError as err:
        raise ConvertError(f"{path}: {err}") from None
    with open_checkpoint(path) as checkpoint:  # a tensor at a time: the model is the peak
        fill_strict(model, checkpoint, f"{path}: converted weights")
    return model.eval()


def cache_bytes_per_token(model, n_tokens: int = 8, as_dtype: torch.dtype | None = None) -> float:
    """Bytes the model's KV cache really allocates per token for its latents, measured on a forward
    pass (the factored layout's RoPE also keeps each token's int64 position beside them, not counted:
    the figure is the one `config.json` and the summary give).

    as_dtype: count the cached values at this dtype's size (the checkpoint's, whatever
    precision the run used).
    """
    device = next(model.parameters()).device
    ids = torch.zeros(1, n_tokens, dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    # `cache` from transformers 5.24 on; `past_key_values` before (deprecated there, with a warning)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * (tensor.element_size() if as_dtype is None else dtype_itemsize(as_dtype))
    return total / n_tokens
