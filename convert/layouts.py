"""Checkpoints seen in the tensor layout conversion and transformers' modules read (`TensorView`).

A checkpoint stored otherwise (Phi-3's fused `qkv_proj`, Mixtral's weights per expert) is presented in the layout read,
the same values rearranged, without rewriting it.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from convert.arch import ARCHS, geometry
from convert.errors import ConvertError

if TYPE_CHECKING:
    from convert.io.tensor_source import TensorSource


@dataclass(frozen=True)
class VirtualTensor:
    """A tensor a view presents that the checkpoint stores as parts of others (`members`),
    built by `assemble(read)` from a reader of stored tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    members: tuple[str, ...]
    assemble: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]


class TensorView:
    """A `TensorSource` (a checkpoint or `StateDictSource`, `stored`) with `virtual` tensors in place of their members.

    Read-only: it adds virtual tensors assembled from stored ones and hides those; every other tensor,
    and the stored source's file-level facts (`config`, `path`, `root`, `files`, `total_bytes`, `close`),
    are the stored source's. It has `stored`'s extras `get`, `read_into` and `raw_chunks` too.
    """

    module_source: "TensorSource"  # only where `attention_view` split a fused q/k/v: the view before the split

    def __init__(self, stored, virtual: dict[str, VirtualTensor]):
        self.stored, self.virtual = stored, virtual
        self.hidden = {member for tensor in virtual.values() for member in tensor.members}
        self._keys = [k for k in stored.keys() if k not in self.hidden] + list(virtual)

    # -- the stored source's own facts (AttributeError where it has none: a state dict has no path)
    config = property(lambda self: self.stored.config, doc="The stored source's config.json dict (or None).")
    path = property(lambda self: self.stored.path, doc="The stored checkpoint's path, as opened.")
    root = property(lambda self: self.stored.root, doc="The stored checkpoint's model directory.")
    files = property(lambda self: self.stored.files, doc="The stored checkpoint's safetensors files.")

    def total_bytes(self) -> int:
        """The stored tensors' bytes (a virtual tensor rearranges the bytes it hides)."""
        return self.stored.total_bytes()

    def close(self) -> None:
        """Close the stored source (its mapped pages leave memory)."""
        self.stored.close()

    # -- TensorSource
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self.virtual or (name in self.stored and name not in self.hidden)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.virtual[name].shape if name in self.virtual else tuple(self.stored.shape(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.virtual[name].dtype if name in self.virtual else self.stored.dtype(name)

    def read(self, name: str) -> torch.Tensor:
        """A stored tensor as `stored.read` gives it; a virtual one assembled from such reads."""
        if name in self.virtual:
            return self.virtual[name].assemble(self.stored.read)
        return self.stored.read(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.virtual:
            return self.read(name)[start:stop]
        return self.stored.read_rows(name, start, stop)

    def raw_span(self, name: str):
        """`stored.raw_span` of a stored tensor; None for a virtual one (it is assembled)."""
        return None if name in self.virtual else self.stored.raw_span(name)

    # -- extras of the stored source
    def entry(self, name: str):
        """The stored record (file, …) of a tensor; a virtual tensor's first member's."""
        return self.stored.entry(self.virtual[name].members[0] if name in self.virtual else name)

    def get(self, name: str) -> torch.Tensor:
        """`stored.get` of a stored tensor (no copy); a virtual one assembled from such tensors."""
        if name in self.virtual:
            return self.virtual[name].assemble(self.stored.get)
        return self.stored.get(name)

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """`stored.read_into` of a stored tensor; a virtual one is assembled, then copied."""
        if name not in self.virtual:
            return self.stored.read_into(name, target)
        with torch.no_grad():
            target.copy_(self.read(name))

    def raw_chunks(self, name: str, size: int | None = None):
        """Stored bytes in pieces (`Checkpoint.raw_chunks`); a virtual tensor in one piece, as
        safetensors lays it out (C order, little-endian)."""
        if name not in self.virtual:
            yield from self.stored.raw_chunks(name, *([size] if size else []))
        else:
            yield self.read(name).contiguous().view(torch.uint8).numpy().tobytes()


def family(config: dict | None):
    """The source family of a config.json dict (a converted one names it in `mla.source_model_type`)."""
    config = config or {}
    model_type = (config.get("mla") or {}).get("source_model_type") or config.get("model_type")
    return next((a for a in ARCHS.values() if model_type in a.model_types), None) if model_type else None


def attention_view(source, config: dict | None):
    """`source` as conversion reads it: in transformers' module layout (`module_layout`), and with
    a fused q/k/v weight (Phi-3's `qkv_proj`) split into the family's q/k/v names (then
    `.module_source` is the view before the split)."""
    source = module_layout(source, config)
    arch = family(config)
    if arch is None or arch.fused_qkv is None:
        return source
    assert config is not None  # a family comes from a config
    view = TensorView(source, _split_qkv(source, arch, config))
    view.module_source = source  # what the family's own modules load (calibration runs them)
    return view


def _split_qkv(source, arch, config: dict) -> dict[str, VirtualTensor]:
    """q, k, v row blocks [H·d | G·d | G·d] of every layer's fused weight."""
    n_heads = config.get("num_attention_heads")
    if n_heads is None:
        raise ConvertError(
            f"config.json has no num_attention_heads, which splits a {arch.name} model's fused {arch.fused_qkv}; "
            "add the model's value"
        )
    n_kv_heads, head_dim = geometry.n_kv_heads(config), geometry.head_dim(config)
    sizes = {arch.q: n_heads * head_dim, arch.k: n_kv_heads * head_dim, arch.v: n_kv_heads * head_dim}
    suffix = f".{arch.fused_qkv}.weight"
    virtual = {}
    for fused in (name for name in source.keys() if name.endswith(suffix)):
        rows, cols = source.shape(fused)[0], source.shape(fused)[1:]
        if rows != sum(sizes.values()):
            raise ConvertError(
                f"{fused} has {rows} rows but q, k and v take (num_attention_heads + 2·num_key_value_heads)·head_dim"
                f" = ({n_heads} + 2·{n_kv_heads})·{head_dim} = {sum(sizes.values())}; config.json does not "
                "describe this checkpoint"
            )
        start, prefix = 0, fused[: -len(suffix) + 1]
        for proj, size in sizes.items():
            rows_of = lambda read, fused=fused, a=start, b=start + size: read(fused)[a:b]
            virtual[f"{prefix}{proj}.weight"] = VirtualTensor((size, *cols), source.dtype(fused), (fused,), rows_of)
            start += size
    return virtual


_EXPERT = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")


def module_layout(source, config: dict | None):
    """`source` with a Mixtral checkpoint's per-expert weights stacked as transformers' modules hold
    them (`mlp.experts.gate_up_proj` = [w1_e; w3_e] per expert e, `mlp.experts.down_proj` = w2_e,
    `mlp.gate` the router); any other checkpoint unchanged."""
    arch = family(config)
    if arch is None or arch.name != "mixtral":
        return source
    experts: dict[str, dict[tuple[int, int], str]] = {}  # layer prefix -> (expert, w) -> name
    for name in source.keys():
        if match := _EXPERT.match(name):
            experts.setdefault(match.group(1), {})[int(match.group(2)), int(match.group(3))] = name
    virtual = {}
    for prefix, names in experts.items():
        count = 1 + max(e for e, _ in names)
        missing = [(e, w) for e in range(count) for w in (1, 2, 3) if (e, w) not in names]
        if missing:
            e, w = missing[0]
            raise ConvertError(
                f"the checkpoint has no {prefix}block_sparse_moe.experts.{e}.w{w}.weight but has expert {count - 1}; "
                "it is incomplete: re-download or re-export it"
            )
        w1, w2, w3 = ([names[e, w] for e in range(count)] for w in (1, 2, 3))
        dtype = source.dtype(w1[0])
        inner, hidden = source.shape(w1[0])
        gate_up = lambda read, w1=w1, w3=w3: torch.stack([torch.cat([read(a), read(b)]) for a, b in zip(w1, w3)])
        down = lambda read, w2=w2: torch.stack([read(a) for a in w2])
        virtual[prefix + "mlp.experts.gate_up_proj"] = VirtualTensor(
            (count, 2 * inner, hidden), dtype, tuple(w1 + w3), gate_up
        )
        virtual[prefix + "mlp.experts.down_proj"] = VirtualTensor((count, hidden, inner), dtype, tuple(w2), down)
        router = prefix + "block_sparse_moe.gate.weight"
        if router in source:
            route = lambda read, r=router: read(r)
            virtual[prefix + "mlp.gate.weight"] = VirtualTensor(
                tuple(source.shape(router)), source.dtype(router), (router,), route
            )
    return TensorView(source, virtual) if virtual else source
