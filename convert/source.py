"""Reading one layer's attention out of a checkpoint (file-backed or in memory).

Everything that can be checked from headers is checked before any output is
written; non-finite values are caught as each layer is read.
"""

from collections.abc import Mapping

import torch

from convert.arch import AttentionSpec
from convert.errors import ConvertError
from convert.transform import LayerWeights

PROJECTIONS = ("q", "k", "v", "o")


class StateDictSource:
    """An in-memory state dict as a `TensorSource` (`convert.io.tensor_source`), with `Checkpoint`'s
    `get` and `read_into`. Its tensors are the dict's own: `get` and `read` give the same tensor."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], config: dict | None):
        self.state_dict, self.config = state_dict, config

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def __contains__(self, name: object) -> bool:
        return name in self.state_dict

    def shape(self, name: str) -> tuple[int, ...]:
        if isinstance(self.state_dict, LazyTensors):  # from the header, nothing read
            return self.state_dict.checkpoint.shape(name)
        return tuple(self.state_dict[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        if isinstance(self.state_dict, LazyTensors):
            return self.state_dict.checkpoint.dtype(name)
        return self.state_dict[name].dtype

    def get(self, name: str) -> torch.Tensor:
        """The dict's own tensor (a `LazyTensors` dict reads it: `Checkpoint.read`)."""
        return self.state_dict[name]

    def read(self, name: str) -> torch.Tensor:
        """As `get`: in memory there is no mapping to keep clear of."""
        return self.state_dict[name]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor (the embedding / lm_head, read in pieces when streaming)."""
        return self.state_dict[name][start:stop]

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Copy the tensor into `target` (any dtype and device), as `Checkpoint.read_into` reads it."""
        with torch.no_grad():
            target.copy_(self.state_dict[name])

    def raw_span(self, name: str) -> None:
        """None: an in-memory tensor has no stored bytes to copy."""
        return None


class LazyTensors(Mapping):
    """A checkpoint's tensors as a read-only mapping that reads each one when it is asked for
    (`Checkpoint.read`: its own memory, freed with it), so a whole-model export holds one
    tensor of the source at a time instead of all of them."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self._names = list(checkpoint.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.checkpoint:
            raise KeyError(name)
        return self.checkpoint.read(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.checkpoint


def expected_shapes(spec: AttentionSpec) -> dict[str, tuple[int, ...]]:
    """Weight shapes per projection, [out, in] as nn.Linear stores them."""
    q_out, kv_out, hidden = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.hidden_size
    return {"q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden), "o": (hidden, q_out)}


def norm_names(spec: AttentionSpec, layer: int) -> dict[str, str]:
    """The q/k norm weights of `layer` by LayerWeights field (none without q/k norm)."""
    if spec.qk_norm is None:
        return {}
    return {f"{p}_norm": f"{spec.prefix(layer)}{p}_norm.weight" for p in "qk"}


def norm_shape(spec: AttentionSpec, proj: str) -> tuple[int]:
    """The q ("q") or k ("k") norm weight's shape: (d,) per head, else the whole projection's."""
    if spec.qk_norm == "head":
        return (spec.head_dim,)
    return ((spec.n_heads if proj == "q" else spec.n_kv_heads) * spec.head_dim,)


def attention_names(source, spec: AttentionSpec, layer: int) -> list[str]:
    """Every attention tensor of `layer` present in the source (weights, biases, q/k norms)."""
    names = [spec.tensor(layer, p, kind) for p in PROJECTIONS for kind in ("weight", "bias")]
    return [n for n in names + list(norm_names(spec, layer).values()) if n in source]


def check_layer(source, spec: AttentionSpec, layer: int) -> None:
    """Presence, shapes and dtypes of one layer's attention tensors, from headers only; the
    dtypes of the layer's other tensors too (and with layer 0, the model-level ones)."""
    _check_attention_shapes(source, spec, layer)
    names = attention_names(source, spec, layer) + spec.other_tensors(layer)
    if layer == 0:
        names += spec.other_tensors(None)
    for name in names:
        if name in source:
            _check_floating(source, name)


#: The dtypes a source's weights may be stored in: what the factorizations, verification's bounds and every
#: target are written for. float8 (F8_E4M3, F8_E5M2) is a quantized checkpoint's, with its own scales.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_floating(source, name: str) -> None:
    """A weight stored as integers or booleans is a damaged header (e.g. F32 relabelled I32), never a model;
    one in float8 is a quantized checkpoint, which convert does not read."""
    dtype = source.dtype(name)
    if dtype in WEIGHT_DTYPES:
        return
    where = f"{source.entry(name).file}: " if hasattr(source, "entry") else ""
    stored = f"{where}{name} is stored as {str(dtype).removeprefix('torch.')}"
    if not dtype.is_floating_point:
        raise ConvertError(
            f"{stored}, but model weights are floating point; "
            "the checkpoint's header is damaged or it is quantized: re-export it in float16/bfloat16/float32"
        )
    raise ConvertError(
        f"{stored}, a quantized format convert does not read; "
        "dequantize the checkpoint to bfloat16 (or float16/float32) and convert that"
    )


def _check_attention_shapes(source, spec: AttentionSpec, layer: int) -> None:
    for proj, shape in expected_shapes(spec).items():
        name = spec.tensor(layer, proj)
        if name not in source:
            raise ConvertError(
                f"layer {layer} has no {name!r}; the checkpoint is incomplete or not a {spec.arch.name} model"
            )
        if tuple(source.shape(name)) != shape:
            raise ConvertError(
                f"{name} has shape {list(source.shape(name))}, expected {list(shape)} from n_heads={spec.n_heads}, "
                f"n_kv_heads={spec.n_kv_heads}, head_dim={spec.head_dim}, hidden_size={spec.hidden_size}; "
                "config.json (or the flags) do not describe this checkpoint"
            )
        bias = spec.tensor(layer, proj, "bias")
        if bias in source and tuple(source.shape(bias)) != shape[:1]:
            raise ConvertError(f"{bias} has shape {list(source.shape(bias))}, expected {[shape[0]]}")
    for name in norm_names(spec, layer).values():
        if name not in source:
            raise ConvertError(
                f"layer {layer} has no {name!r}, which a {spec.arch.name} model (q/k norm) has; the "
                "checkpoint is incomplete or not this architecture: check config.json model_type"
            )
    for field, name in norm_names(spec, layer).items():
        want = norm_shape(spec, field[0])
        if tuple(source.shape(name)) != want:
            raise ConvertError(
                f"{name} has shape {list(source.shape(name))}, expected {list(want)} (a {spec.qk_norm} q/k norm of "
                f"n_heads={spec.n_heads}, n_kv_heads={spec.n_kv_heads}, head_dim={spec.head_dim})"
            )


def read_layer(source, spec: AttentionSpec, layer: int) -> LayerWeights:
    """Load one layer's attention tensors, refusing NaN/Inf with the tensor's name. From a
    checkpoint they are read with plain file reads (`Checkpoint.read`), not through its mapping,
    whose pages would stay resident until the checkpoint closes."""
    read = source.read
    tensors = {}
    for proj in PROJECTIONS:
        for kind, field in (("weight", proj), ("bias", f"{proj}_bias")):
            name = spec.tensor(layer, proj, kind)
            if name in source:
                tensors[field] = _finite(read(name), name)
    for field, name in norm_names(spec, layer).items():
        tensors[field] = _finite(read(name), name)
    return LayerWeights(**tensors)


def _finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    # A NaN or Inf makes the sum NaN or Inf, so a finite sum proves every value finite (one reduction,
    # cheaper than isfinite().all()); a sum that overflows gets the full check.
    if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise ConvertError(
            f"{name} has {bad} NaN/Inf values; the checkpoint is corrupt, re-export it from a healthy copy"
        )
    return tensor
