"""The `mla` section of a converted config.json as typed values (docs/design.md, "Output format"):
`MLASection` and each layer's `LayerEntry`, parsed and checked once where a checkpoint is loaded.
A field's checks follow from its annotation; the few rules between fields are written out here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin, get_type_hints

from convert.arch import ARCHS
from convert.arch.registry import HEAD_MAPS
from convert.arch.validate import check_field, count, flag, one_of, positive, refuse, string
from convert.errors import ConvertError
from convert.mla.format import FORMAT_VERSION
from convert.options import LATENTS, LAYOUTS

RECONVERT = "re-convert with `convert gqa2mla`"

# The field types of the section: the checker rides on the annotation.
Count = Annotated[int, count]
Positive = Annotated[float, positive]
Flag = Annotated[bool, flag]
Name = Annotated[str, string]
#: Output tensors that may carry a bias, by layout (`convert.transform`; q_proj in the absorbed
#: layout of a q/k-norm model, whose query is normalised live).
BIASED = {"absorbed": ("k_down", "q_absorbed", "q_proj", "o_absorbed"), "factored": ("k_down", "q_proj", "o_proj")}


@dataclass(frozen=True)
class LayerEntry:
    """One `mla.layers[i]`: the latent's ranks (`rank_kv` joint; `rank_k`, `rank_v` separate), the
    source RoPE frequency of each latent key pair (absorbed RoPE only), the biased output tensors,
    and the conversion's figures (the report prints them)."""

    rank_kv: int | None = None
    rank_k: int | None = None
    rank_v: int | None = None
    key_freq_index: tuple[int, ...] | None = None
    bias: tuple[str, ...] = ()
    retained_energy: dict[str, float] | None = None
    factor_error: dict[str, float] | None = None

    @property
    def ranks(self) -> dict[str, int]:
        """The ranks this latent has, by name (what `convert.mla.shapes.output_shapes` takes)."""
        return {k: v for k in ("rank_kv", "rank_k", "rank_v") if (v := getattr(self, k)) is not None}

    @property
    def key_rank(self) -> int:
        """r_K: the cached key latent's width (joint: the one latent)."""
        rank = self.rank_kv if self.rank_kv is not None else self.rank_k
        assert rank is not None  # a checked entry has rank_kv (joint) or rank_k and rank_v (split)
        return rank

    @property
    def value_rank(self) -> int:
        """r_V: the value latent's width (joint: the one latent)."""
        rank = self.rank_kv if self.rank_kv is not None else self.rank_v
        assert rank is not None  # a checked entry has rank_kv (joint) or rank_k and rank_v (split)
        return rank


@dataclass(frozen=True)
class MLASection:
    """config.json's `mla` section: the model's geometry and how it was converted. Fields up to
    `layer_prefix` are required in every format; the rest are optional (absent: the default)."""

    format_version: Count
    converter: Name
    source_architecture: Annotated[str, one_of(tuple(ARCHS))]
    layout: Annotated[str, one_of(LAYOUTS)]
    latent: Annotated[str, one_of(LATENTS)]
    head_map: Annotated[str, one_of(HEAD_MAPS)]
    n_layers: Count
    hidden_size: Count
    n_heads: Count
    n_kv_heads: Count
    head_dim: Count
    softmax_scale: Positive
    causal: Flag
    layer_prefix: Name
    layers: tuple[LayerEntry, ...] = ()
    source_model_type: str | None = None
    rope: str | None = None  # the source's RoPE convention (`ArchSpec.rope`, "rotate_half"); None: no RoPE
    qk_norm: str | None = None  # "head" (per head) or "whole" (the whole projection)
    norm_eps: float | None = None
    norm_unit_offset: bool = False  # Gemma 3: q/k norms scale by (1 + weight)
    rotary_dim: int | None = None  # partial RoPE: the rotated dims per head
    softcap: float | None = None  # Gemma 2: scores -> cap·tanh(scores/cap)
    notes: tuple[str, ...] = ()
    compression: dict | None = None

    @property
    def joint(self) -> bool:
        """One latent for keys and values (`rank_kv`)."""
        return self.latent == "joint"

    @property
    def has_rope(self) -> bool:
        return self.rope is not None

    def prefix(self, layer: int) -> str:
        """Layer `layer`'s tensor-name prefix (`model.layers.3.self_attn.`)."""
        return self.layer_prefix.format(i=layer)

    @classmethod
    def parse(cls, mla: Any, where: str) -> MLASection:
        """The section of a config.json at `where`, checked: types and known values, its format
        version, its layer entries; each refusal is one line naming the field and the fix (exit 2)."""
        if not isinstance(mla, dict):
            raise refuse(where, "mla", mla, ("is not an object", "the section `convert gqa2mla` writes"), RECONVERT)
        _check_format_version(mla, where)
        hints = get_type_hints(cls, include_extras=True)
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        for name in required[1:]:  # format_version: checked first, above
            if name not in mla:
                raise ConvertError(f"{where} mla has no {name!r}; {RECONVERT}")
            check_field(where, f"mla.{name}", mla[name], _checker(hints[name]), RECONVERT)
        _check_between(mla, where)
        _check_descriptive(mla, where)
        _check_layers(mla, where)
        return cls.from_dict(mla)

    @classmethod
    def from_dict(cls, mla: dict) -> MLASection:
        """The typed values of a section this process wrote (`convert.mla.format`), unchecked;
        a section read from a file goes through `parse`."""
        names = {f.name for f in dataclasses.fields(cls)} - {"layers", "notes", "norm_unit_offset"}
        return cls(
            **{k: v for k, v in mla.items() if k in names},
            layers=tuple(_layer_entry(entry) for entry in mla.get("layers", ())),
            notes=tuple(mla.get("notes", ())),
            norm_unit_offset=bool(mla.get("norm_unit_offset")),
        )


def _checker(annotation):
    """The checker an `Annotated[type, checker]` field carries."""
    assert get_origin(annotation) is Annotated, annotation
    return get_args(annotation)[1]


def _check_format_version(mla: dict, where: str) -> None:
    """A format this version reads: the one it writes or an older one (1…); a newer one needs a newer convert."""
    version = mla.get("format_version")
    check_field(where, "mla.format_version", version, count, RECONVERT)
    assert isinstance(version, int)  # check_field refused anything but a count
    if version > FORMAT_VERSION:
        raise ConvertError(
            f"{where} mla.format_version={version}: written by a newer convert (this one reads formats 1 to "
            f"{FORMAT_VERSION}); upgrade convert"
        )


def _check_between(mla: dict, where: str) -> None:
    """The rules between fields: whole heads per KV head, no RoPE keys in a joint latent."""
    if mla["n_heads"] % mla["n_kv_heads"]:
        raise ConvertError(
            f"{where} mla.n_heads={mla['n_heads']} is not divisible by mla.n_kv_heads={mla['n_kv_heads']}; {RECONVERT}"
        )
    if mla.get("rope") is not None and mla["latent"] == "joint":
        raise ConvertError(
            f"{where} mla.latent='joint' with RoPE keys is a combination convert never writes; {RECONVERT}"
        )


def _check_descriptive(mla: dict, where: str) -> None:
    """The fields only reports read: notes (strings), compression (an object or null)."""
    notes = mla.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise refuse(where, "mla.notes", notes, ("is not a list of strings", "a list of strings"), RECONVERT)
    compression = mla.get("compression")
    if compression is not None and not isinstance(compression, dict):
        raise refuse(where, "mla.compression", compression, ("is not an object", "an object or null"), RECONVERT)


# ------------------------------------------------------------------ the layer entries


def _check_layers(mla: dict, where: str) -> None:
    """`mla.layers`: one well-formed entry per layer."""
    layers = mla.get("layers")
    if not isinstance(layers, list):
        raise refuse(where, "mla.layers", layers, ("is not a list", "one entry per layer"), RECONVERT)
    if len(layers) != mla["n_layers"]:
        raise ConvertError(
            f"{where} mla.layers has {len(layers)} entries but mla.n_layers={mla['n_layers']}; {RECONVERT}"
        )
    for i, entry in enumerate(layers):
        _check_layer(entry, i, mla, where)


def _check_layer(entry: Any, i: int, mla: dict, where: str) -> None:
    """One `mla.layers[i]`: its ranks, RoPE frequencies, biases and figures."""
    field = f"mla.layers[{i}]"
    if not isinstance(entry, dict):
        raise refuse(where, field, entry, ("is not an object", "the layer entry convert writes"), RECONVERT)
    ranks = ("rank_kv",) if mla["latent"] == "joint" else ("rank_k", "rank_v")
    extra = sorted(k for k in entry if k.startswith("rank") and k not in ranks)
    if extra:
        raise ConvertError(f"{where} {field} has {extra[0]!r}, not a rank of a {mla['latent']} latent; {RECONVERT}")
    for rank in ranks:
        if rank not in entry:
            raise ConvertError(f"{where} {field} has no {rank!r}; {RECONVERT}")
        check_field(where, f"{field}.{rank}", entry[rank], count, RECONVERT)
    _check_freq_index(entry, field, mla, where)
    bias = entry.get("bias", [])
    allowed = BIASED[mla["layout"]]
    if not isinstance(bias, list) or not all(b in allowed for b in bias) or len(set(bias)) != len(bias):
        problem = ("is not a list of biased tensors", f"a list drawn from {', '.join(allowed)}")
        raise refuse(where, f"{field}.bias", bias, problem, RECONVERT)
    for figures in ("retained_energy", "factor_error"):
        _check_figures(entry.get(figures), f"{field}.{figures}", where)


def _layer_entry(entry: dict) -> LayerEntry:
    """A layer's typed entry (its fields as written; `key_freq_index` and `bias` as tuples)."""
    freq = entry.get("key_freq_index")
    names = ("rank_kv", "rank_k", "rank_v", "retained_energy", "factor_error")
    return LayerEntry(
        **{k: entry[k] for k in names if k in entry},
        key_freq_index=None if freq is None else tuple(freq),
        bias=tuple(entry.get("bias", ())),
    )


def _check_freq_index(entry: dict, field: str, mla: dict, where: str) -> None:
    """key_freq_index: with RoPE in the absorbed layout, the source frequency (< head_dim/2) of
    each of the r_K/2 latent pairs; absent otherwise."""
    freq: Any = entry.get("key_freq_index")  # as read from config.json: its type is checked below
    if mla.get("rope") is None or mla["layout"] != "absorbed":
        if freq is not None:
            raise ConvertError(
                f"{where} {field}.key_freq_index is set but only absorbed RoPE latents have one; {RECONVERT}"
            )
        return
    rank_k, partial = entry["rank_k"], mla.get("rotary_dim")
    half = (partial or mla["head_dim"]) // 2
    static = (mla.get("compression") or {}).get("static_freqs")
    if partial is None and not static and rank_k % 2:
        raise refuse(where, f"{field}.rank_k", rank_k, ("is odd", "an even rank (RoPE pairs)"), RECONVERT)
    # partial RoPE, or static frequencies cached as NoPE (compression): the latent is
    # [rotated pairs | NoPE dims], so its pairs take at most rank_k dims
    fits = isinstance(freq, list) and (2 * len(freq) <= rank_k if partial or static else len(freq) == rank_k // 2)
    if not fits or any(isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < half for j in freq):
        pairs = f"at most rank_k/2={rank_k // 2}" if partial else f"rank_k/2={rank_k // 2}"
        want = f"a list of {pairs} frequency indices below {'rotary_dim' if partial else 'head_dim'}/2={half}"
        raise refuse(where, f"{field}.key_freq_index", freq, ("does not fit the latent", want), RECONVERT)


def _check_figures(figures: Any, field: str, where: str) -> None:
    """retained_energy / factor_error: null or {"k": number, …} (the report prints them)."""
    if figures is None:
        return
    ok = isinstance(figures, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 for v in figures.values()
    )
    if not ok:
        raise refuse(where, field, figures, ("is not a map of numbers", 'null or {"k": 1.0, "v": 1.0}'), RECONVERT)
