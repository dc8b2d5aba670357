"""The conversion plan: every size of a conversion, decided once before a tensor is written.

Per layer the latent ranks and the output tensors' shapes; for the model the KV-cache size per token, the attention
parameter counts and the memory estimates (docs/design.md, "Layout of the code" and "Memory").
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from convert import compress
from convert.arch import AttentionSpec, GeometryFlags, find_arch, resolve_attention
from convert.errors import ConvertError
from convert.hf import meta_state_dict
from convert.io.reader import dtype_itemsize
from convert.io.writer import QUEUE_BYTES
from convert.layouts import attention_view
from convert.linalg import numerical_rank, work_dtype
from convert.linalg.absorb import BLOCK_BYTES
from convert.mla.shapes import output_shapes
from convert.options import ConvertOptions, dtype_name
from convert.source import StateDictSource, attention_names, check_layer, read_layer

SMALL_LAYER_PARAMS = 16 * 2**20  # converted attention parameters below which layers convert side by side


# ------------------------------------------------------------------ formulas


def gqa_cache_dims(spec: AttentionSpec) -> int:
    """Values the GQA KV cache holds per token and layer: keys and values of G heads, 2·G·d."""
    return 2 * spec.n_kv_heads * spec.head_dim


def cache_dims(ranks: dict[str, int]) -> int:
    """Values one MLA layer caches per token: r_K + r_V (split) or r (joint)."""
    return ranks.get("rank_kv", 0) + ranks.get("rank_k", 0) + ranks.get("rank_v", 0)


def exact_ranks(spec: AttentionSpec, latent: str, layout: str, key_bias: bool) -> dict[str, int] | None:
    """The exact latent sizes, known from shapes alone (None for joint: data-dependent)."""
    if latent == "joint":
        return None
    in_k = spec.hidden_size + (1 if key_bias and spec.rope else 0)
    rows = spec.n_kv_heads * spec.head_dim
    if spec.qk_norm is not None:
        rank_k = rows  # the aligned latent: every KV head's key, permuted
    elif spec.rope and layout == "absorbed" and spec.rotary_dim is not None:  # [per-frequency | NoPE]
        rank_k = spec.rotary_dim * min(spec.n_kv_heads, in_k) + min(
            spec.n_kv_heads * (spec.head_dim - spec.rotary_dim), in_k
        )
    elif spec.rope and layout == "absorbed":
        rank_k = spec.head_dim * min(spec.n_kv_heads, in_k)  # 2 · (d/2 freqs) · min(G, X) per freq
    else:
        rank_k = min(rows, in_k)
    return {"rank_k": rank_k, "rank_v": min(rows, spec.hidden_size)}


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class LayerPlan:
    """One layer: its latent ranks and its output tensors (names relative to the layer prefix)."""

    ranks: dict[str, int]
    shapes: dict[str, tuple[int, ...]]

    @property
    def cache_dims(self) -> int:
        return cache_dims(self.ranks)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())


@dataclass
class ConversionPlan:
    """Everything a conversion will produce, before it produces it."""

    spec: AttentionSpec
    layout: str
    latent: str
    dtype: torch.dtype  # of the source attention tensors, and so of the converted ones
    layers: list[LayerPlan]
    replaced: set[str]  # source tensors the conversion replaces (every layer's attention)
    source_tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype), all of them

    # ---- KV cache, per token (all layers)
    @property
    def gqa_cache_dims(self) -> int:
        return self.spec.n_layers * gqa_cache_dims(self.spec)

    def budget_dims(self, ratio: float) -> int:
        """Cache dims per token (all layers) a --kv-cache-ratio allows."""
        return budget_dims(self.spec, ratio)

    @property
    def cache_dims(self) -> int:
        return sum(layer.cache_dims for layer in self.layers)

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> tuple[int, int]:
        """(GQA, MLA) KV-cache bytes per token in `dtype` (default the checkpoint's)."""
        size = dtype_itemsize(dtype or self.dtype)
        return self.gqa_cache_dims * size, self.cache_dims * size

    # ---- tensors
    def output_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor of the converted checkpoint: name -> (shape, dtype), the writer's layout."""
        out = {name: entry for name, entry in self.source_tensors.items() if name not in self.replaced}
        for i, layer in enumerate(self.layers):
            out |= {self.spec.prefix(i) + name: (shape, self.dtype) for name, shape in layer.shapes.items()}
        return out

    @property
    def attention_params_before(self) -> int:
        return sum(math.prod(self.source_tensors[name][0]) for name in self.replaced)

    @property
    def attention_params_after(self) -> int:
        return sum(layer.params for layer in self.layers)

    def sizes(self) -> dict:
        """Attention parameters and KV cache per token, before and after, in the checkpoint's dtype."""
        size = dtype_itemsize(self.dtype)
        before, after = self.cache_bytes_per_token()
        return {
            "attention_params_before": self.attention_params_before,
            "attention_params_after": self.attention_params_after,
            "attention_bytes_before": self.attention_params_before * size,
            "attention_bytes_after": self.attention_params_after * size,
            "kv_cache_dims_per_token_before": self.gqa_cache_dims,
            "kv_cache_dims_per_token_after": self.cache_dims,
            "kv_cache_bytes_per_token_before": before,
            "kv_cache_bytes_per_token_after": after,
            "dtype": dtype_name(self.dtype),
        }

    # ---- memory
    @property
    def checkpoint_bytes(self) -> int:
        return sum(math.prod(shape) * dtype_itemsize(dtype) for shape, dtype in self.source_tensors.values())

    def layer_workers(self) -> int:
        """Layers converted at once (`api._convert_layers`): small layers' factorizations (SmolLM2:
        576 × 576) leave cores idle inside one op, so two run side by side, one thread each; a
        large layer's ops use every core by themselves."""
        small = max(layer.params for layer in self.layers) < SMALL_LAYER_PARAMS
        return min(2, os.cpu_count() or 1) if small else 1

    def conversion_memory_bytes(self) -> int:
        """Peak tensor memory of the streamed conversion (`api._convert_layers`): for each layer
        in flight, its source attention as read and in the working precision (`work_dtype`:
        float64, float32 for a half-precision checkpoint), its outputs (the absorbed Ŵ^Q, Ŵ^O in
        the checkpoint's dtype, the rest in the working precision, and the per-head
        up-projections they are made from), one block of absorbed products, and the writer's
        queue (`QUEUE_BYTES`, or all the converted tensors if fewer) plus the tensor it is
        writing. Tensors copied through are copied file to file: no memory."""
        size, work = dtype_itemsize(self.dtype), dtype_itemsize(work_dtype(self.dtype))
        absorbed = ("q_absorbed.", "o_absorbed.")

        def layer_bytes(i: int, layer: LayerPlan) -> int:
            out = sum(math.prod(s) * (size if n.startswith(absorbed) else work) for n, s in layer.shapes.items())
            ups = 2 * self.spec.n_heads * self.spec.head_dim * max(layer.ranks.values()) * work
            return self._layer_source_params(i) * (size + work) + out + ups

        in_flight = self.layer_workers() * max(layer_bytes(i, layer) for i, layer in enumerate(self.layers))
        converted = sum(layer.params for layer in self.layers) * size
        largest = max(math.prod(s) for layer in self.layers for s in layer.shapes.values()) * size
        return in_flight + BLOCK_BYTES + min(QUEUE_BYTES, converted) + largest

    def _layer_source_params(self, layer: int) -> int:
        prefix = self.spec.prefix(layer)
        return sum(math.prod(self.source_tensors[n][0]) for n in self.replaced if n.startswith(prefix))


# ------------------------------------------------------------------ planning


def make_plan(source, spec: AttentionSpec, opts: ConvertOptions, stats=None) -> ConversionPlan:
    """The plan of converting `source` (a checkpoint or state dict) with `opts`.

    Reads headers only for an exact split latent; the K/V weights otherwise
    (joint: the rank of [W^K; W^V]; global allocation: the weighted spectra).
    stats: calibration statistics per layer (`compress.calibrate`), or None.
    """
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)
    requested = _requested_ranks(source, spec, opts, stats)
    layers = []
    for layer in range(spec.n_layers):
        ranks = exact = _exact_layer_ranks(source, spec, layer, opts)
        if requested is not None:
            ranks = _checked(requested[layer], exact, layer, spec, opts)
        layers.append(LayerPlan(ranks, output_shapes(spec, ranks, opts.layout, _biases(source, spec, layer))))
    replaced = {n for layer in range(spec.n_layers) for n in attention_names(source, spec, layer)}
    tensors = {name: (tuple(source.shape(name)), source.dtype(name)) for name in source.keys()}
    dtype = source.dtype(spec.tensor(0, "q"))
    return ConversionPlan(spec, opts.layout, opts.latent, dtype, layers, replaced, tensors)


def resolve_spec(source, config: dict | None, opts: ConvertOptions) -> AttentionSpec:
    """The attention spec of `source`, with the options' geometry flags; refuses what cannot convert."""
    flags = GeometryFlags(opts.arch, opts.n_heads, opts.n_kv_heads, opts.head_dim, opts.head_map)
    spec = resolve_attention(config, source.keys(), source.shape, flags)
    if opts.latent == "joint" and spec.rope:
        raise ConvertError(
            "--latent joint needs keys without RoPE: a shared K/V latent cannot carry the per-frequency "
            "rotation of RoPE keys exactly; use --latent split (the default)"
        )
    lossy = _compresses(source, spec, opts)
    if spec.qk_norm is not None:
        _check_qk_norm_options(spec, opts, lossy)
    if spec.rotary_dim is not None and opts.layout == "absorbed" and lossy:
        raise ConvertError(
            f"compressing partial RoPE (the first {spec.rotary_dim} of head_dim={spec.head_dim} dims rotate) in the "
            "absorbed layout is not implemented: its latent keeps the rotary and NoPE parts exact; use "
            "--layout factored to compress, or drop --rank/--kv-cache-ratio"
        )
    if spec.rope and opts.layout == "absorbed" and lossy and opts.latent == "split" and opts.nope_angle > 0:
        spec = dataclasses.replace(spec, static_freqs=compress.static_frequencies(spec, config or {}, opts.nope_angle))
    return spec


def _compresses(source, spec: AttentionSpec, opts: ConvertOptions) -> bool:
    """Whether the options ask for less than the exact ranks (an explicit exact --rank does not)."""
    if opts.rank is not None and opts.latent == "split":
        return any(opts.rank < limit for limit in _exact_layer_ranks(source, spec, 0, opts).values())
    return opts.lossy


def _check_qk_norm_options(spec: AttentionSpec, opts: ConvertOptions, compressing: bool) -> None:
    """What a q/k-norm conversion (aligned key latent, native runtime) does not cover."""
    name = f"a {spec.arch.name} model (q/k norm)"
    if not compressing:
        return
    if opts.layout == "absorbed":
        raise ConvertError(
            f"compressing {name} in the absorbed layout is not implemented: the normed keys are "
            "compressed after the norm, and RoPE then acts on them, which only the factored layout "
            "applies after the up-projection; use --layout factored"
        )
    if opts.resolved_method == "svd":
        raise ConvertError(
            f"compressing {name} needs calibration: the normed keys are compressed, and only their "
            "statistics on real text say which directions matter; add --calib FILE (method fisher or whitened)"
        )


def budget_dims(spec: AttentionSpec, ratio: float) -> int:
    """Cache dims per token (all layers) a --kv-cache-ratio allows."""
    return round(ratio * spec.n_layers * gqa_cache_dims(spec))


def _biases(source, spec: AttentionSpec, layer: int) -> set[str]:
    return {p for p in "qkvo" if spec.tensor(layer, p, "bias") in source}


def _exact_layer_ranks(source, spec: AttentionSpec, layer: int, opts: ConvertOptions) -> dict[str, int]:
    """The ranks at which one layer's conversion is exact."""
    exact = exact_ranks(spec, opts.latent, opts.layout, "k" in _biases(source, spec, layer))
    if exact is None:  # joint: the true rank of [W^K; W^V]
        k, v = source.get(spec.tensor(layer, "k")), source.get(spec.tensor(layer, "v"))
        exact = {"rank_kv": numerical_rank(torch.cat([k, v]).double())}
    return exact


def check_rank(source, spec: AttentionSpec, opts: ConvertOptions) -> ConvertOptions:
    """Refuse a --rank above the exact one before any calibration or writing; a --rank equal to
    the exact one is the exact conversion (returned options without it). Split latent only: its
    exact ranks are known from shapes (joint: from the weights, checked when planning)."""
    if opts.rank is None or opts.latent == "joint":
        return opts
    exact = _exact_layer_ranks(source, spec, 0, opts)
    _checked(dict.fromkeys(exact, opts.rank), exact, 0, spec, opts)
    if all(opts.rank == limit for limit in exact.values()):
        return dataclasses.replace(opts, rank=None)
    return opts


def _checked(requested: dict[str, int], exact: dict[str, int], layer: int, spec: AttentionSpec, opts) -> dict:
    """Requested ranks, refused above the exact ones, when nothing is compressed, or odd for
    a RoPE key latent."""
    limits = ", ".join(f"{name} {limit}" for name, limit in exact.items())
    flag = "--rank" if opts.rank is not None else "rank"
    for name, limit in exact.items():
        if requested[name] > limit:
            raise ConvertError(
                f"{flag} {requested[name]} is above the exact rank of layer {layer} ({limits}): a latent cannot "
                f"hold more than its exact rank; omit --rank for the exact conversion, or give fewer dims to compress"
            )
    if spec.rope and opts.layout == "absorbed" and not spec.static_freqs and requested.get("rank_k", 0) % 2:
        raise ConvertError(
            f"--rank {requested['rank_k']} is odd: a RoPE key latent has pairs of dims; use an even rank"
        )
    return requested


def _requested_ranks(source, spec: AttentionSpec, opts: ConvertOptions, stats) -> list[dict] | None:
    """Per-layer ranks asked for by --rank / --kv-cache-ratio (None: exact)."""
    if not opts.lossy:
        return None
    names = ("rank_kv",) if opts.latent == "joint" else ("rank_k", "rank_v")
    if opts.rank is not None:
        return [dict.fromkeys(names, opts.rank)] * spec.n_layers
    assert opts.kv_cache_ratio is not None  # lossy without --rank: --kv-cache-ratio asks it
    per_layer = round(opts.kv_cache_ratio * gqa_cache_dims(spec))
    if opts.latent == "joint":
        return [{"rank_kv": per_layer}] * spec.n_layers
    if opts.resolved_allocation == "uniform":
        return [compress.uniform_ranks(spec, opts.layout, per_layer)] * spec.n_layers
    latents = []
    for layer in range(spec.n_layers):
        weights = read_layer(source, spec, layer)
        latents += compress.layer_latents(
            layer, weights, spec, opts.layout, layer_weighting(spec, opts, stats, weights, layer)
        )
    return compress.allocate_global(
        latents, budget_dims(spec, opts.kv_cache_ratio), normalize=opts.resolved_method != "fisher"
    )


def layer_weighting(spec: AttentionSpec, opts: ConvertOptions, stats, weights, layer: int):
    """The compression weighting of one layer (None: plain SVD)."""
    if stats is None:
        return None
    return compress.layer_weighting(opts.resolved_method, weights, spec, opts.layout, stats[layer], opts.shrinkage)


# ------------------------------------------------------------------ from a config alone


def plan_for_config(config: dict, **options) -> ConversionPlan:
    """Plan the conversion of a model described only by its config.json (no weights).

    options: the fields of `ConvertOptions`; only what needs no weights (the exact
    rank, or --rank, with the split latent) can be planned this way. The tensors
    are meta tensors: shapes and dtypes, no data.
    """
    opts = ConvertOptions.from_kwargs(**options)
    find_arch(
        config.get("model_type"), opts.arch, config
    )  # an unsupported family is refused before transformers sees it
    if opts.latent == "joint" or opts.kv_cache_ratio is not None:
        raise ConvertError("planning from a config alone reads no weights: use the split latent and --rank (or none)")
    source = attention_view(StateDictSource(meta_state_dict(config), config), config)
    return make_plan(source, resolve_spec(source, config, opts), opts)
