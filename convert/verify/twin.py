"""The noise floor of a half-precision checkpoint: an equivalent twin of the original (docs/design.md, "Verification").

Its attention weights are an exact reparametrisation of the original's, rounded back to the checkpoint's dtype: it
differs from the original by one more rounding of every attention weight, which is what an exact conversion costs too.
"""

import torch

from convert.arch import ARCHS, geometry
from convert.layouts import TensorView, VirtualTensor, family

#: The reparametrisation's factor: irrational, so s·w rounds like a fresh product (a power of two
#: would round nothing), and near 1, so no weight moves towards over- or underflow.
TWIN_SCALE = 2 ** (1 / 3)


def _scaled(name: str, factors: torch.Tensor | float, dtype: torch.dtype):
    """A `VirtualTensor.assemble` for tensor `name` times `factors` (a scalar, or one factor per row), in
    float64, rounded to `dtype`."""

    def assemble(read):
        weight = read(name).double()
        scale = factors if isinstance(factors, float) else factors.reshape(-1, *[1] * (weight.dim() - 1))
        return (weight * scale).to(dtype)

    return assemble


#: Each projection's factor (the names of `ArchSpec.tensor`): queries and values up, keys and outputs down.
FACTORS = {"q": TWIN_SCALE, "k": 1 / TWIN_SCALE, "v": TWIN_SCALE, "o": 1 / TWIN_SCALE}


def twin_view(original, config: dict) -> TensorView:
    """`original` (in transformers' module layout) with every layer's attention weights reparametrised
    and rounded to their stored dtype: the equivalent twin. config: a converted config.json (its `mla`
    section gives the geometry) or the source's."""
    mla = config.get("mla") or _geometry(config)
    arch = ARCHS[mla["source_architecture"]]
    virtual = {}
    for layer in range(mla["n_layers"]):
        prefix = mla["layer_prefix"].format(i=layer)
        for proj, factor in FACTORS.items():
            kinds = ("weight",) if proj == "o" else ("weight", "bias")  # b_O is added after W^O: unchanged
            for kind in kinds:
                name = arch.tensor(prefix, proj, kind)
                if name in original:
                    virtual[name] = _virtual(original, name, factor)
        if arch.fused_qkv is not None:  # Phi-3: rows [q | k | v] of one weight
            name = f"{prefix}{arch.fused_qkv}.weight"
            if name in original:
                virtual[name] = _virtual(original, name, _fused_factors(mla))
    return TensorView(original, virtual)


def _geometry(config: dict) -> dict:
    """What `twin_view` reads of an `mla` section, from a source config.json."""
    arch = family(config)
    n_heads = config["num_attention_heads"]
    return {
        "source_architecture": arch.name,
        "n_layers": config["num_hidden_layers"],
        "layer_prefix": arch.layer_prefixes[0],
        "n_heads": n_heads,
        "n_kv_heads": geometry.n_kv_heads(config),
        "head_dim": geometry.head_dim(config),
    }


def _fused_factors(mla: dict) -> torch.Tensor:
    """One factor per row of a fused [q | k | v] weight (H·d, G·d and G·d rows)."""
    rows = {"q": mla["n_heads"] * mla["head_dim"], "k": mla["n_kv_heads"] * mla["head_dim"]}
    rows["v"] = rows["k"]
    return torch.cat([torch.full((n,), FACTORS[p], dtype=torch.float64) for p, n in rows.items()])


def _virtual(original, name: str, factors) -> VirtualTensor:
    dtype = original.dtype(name)
    return VirtualTensor(tuple(original.shape(name)), dtype, (name,), _scaled(name, factors, dtype))
