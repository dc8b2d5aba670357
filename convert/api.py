"""The Python API: plan -> transform -> write -> verify. No click, no printing.

result = convert.gqa2mla("model_dir", "model_dir-mla")
mla_sd = convert.convert_state_dict(model.state_dict(), model.config)
"""

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from convert import __version__, compress
from convert.arch import AttentionSpec, resolve_attention
from convert.errors import ConvertError
from convert.io import Checkpoint, CheckpointWriter, open_checkpoint, parse_size
from convert.linalg import numerical_rank
from convert.options import ConvertOptions
from convert.source import StateDictSource, attention_names, check_layer, read_layer
from convert.text import text_token_ids
from convert.transform import LayerInfo, convert_layer, exact_ranks, output_shapes

FORMAT_VERSION = 1
# Files of a Hugging Face model directory that travel with the weights.
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass
class ConversionResult:
    """What `gqa2mla` did. `passed` is None when verification was skipped."""

    output: Path
    config: dict
    layers: list[LayerInfo]
    sizes: dict
    timings: dict
    report: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool | None:
        return None if self.report is None else self.report["verdict"] == "PASS"


class MLAStateDict(dict):
    """The converted state dict; `.config` is the output config (with its `mla` section)."""

    config: dict
    layers: list[LayerInfo]


# ------------------------------------------------------------------ planning


def _spec(source, config: dict | None, opts: ConvertOptions) -> AttentionSpec:
    spec = resolve_attention(
        config,
        source.keys(),
        source.shape,
        arch=opts.arch,
        n_heads=opts.n_heads,
        n_kv_heads=opts.n_kv_heads,
        head_dim=opts.head_dim,
        head_map=opts.head_map,
    )
    if opts.latent == "joint" and spec.rope:
        raise ConvertError(
            "--latent joint needs keys without RoPE: a shared K/V latent cannot carry the per-frequency "
            "rotation of RoPE keys exactly; use --latent split (the default)"
        )
    return spec


def _biases(source, spec: AttentionSpec, layer: int) -> set[str]:
    return {p for p in "qkvo" if spec.tensor(layer, p, "bias") in source}


def _exact_layer_ranks(source, spec: AttentionSpec, layer: int, opts: ConvertOptions) -> dict[str, int]:
    """The ranks at which one layer's conversion is exact."""
    exact = exact_ranks(spec, opts.latent, opts.layout, "k" in _biases(source, spec, layer))
    if exact is None:  # joint: the true rank of [W^K; W^V]
        k, v = source.get(spec.tensor(layer, "k")), source.get(spec.tensor(layer, "v"))
        exact = {"rank_kv": numerical_rank(torch.cat([k, v]).double())}
    return exact


def _checked(requested: dict[str, int], exact: dict[str, int], layer: int, spec: AttentionSpec, opts) -> dict[str, int]:
    """Requested ranks, refused above the exact ones (or odd for a RoPE key latent)."""
    for name, limit in exact.items():
        if requested[name] > limit:
            flag = "--rank" if opts.rank is not None else "rank"
            raise ConvertError(
                f"{flag} {requested[name]} is above the exact {name} {limit} of layer {layer}; "
                "at the exact rank the conversion is already lossless, so omit --rank or lower it"
            )
    if spec.rope and opts.layout == "absorbed" and requested.get("rank_k", 0) % 2:
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
    if opts.latent == "joint":
        return [{"rank_kv": round(opts.kv_cache_ratio * 2 * spec.n_kv_heads * spec.head_dim)}] * spec.n_layers
    latents = []
    if opts.resolved_allocation == "global":
        for layer in range(spec.n_layers):
            weights = read_layer(source, spec, layer)
            weighting = _weighting(weights, spec, opts, stats, layer)
            latents += compress.layer_latents(layer, weights, spec, opts.layout, weighting)
    return compress.plan_ranks(
        latents, spec, opts.layout, opts.kv_cache_ratio, opts.resolved_allocation, opts.resolved_method
    )


def _weighting(weights, spec: AttentionSpec, opts: ConvertOptions, stats, layer: int):
    if stats is None:
        return None
    return compress.layer_weighting(opts.resolved_method, weights, spec, opts.layout, stats[layer])


def _plan_layers(source, spec: AttentionSpec, opts: ConvertOptions, stats=None) -> list[dict]:
    """Per layer: ranks and output tensor shapes, all decided before anything is written.
    Reads headers only for an exact split latent; the K/V weights otherwise."""
    for layer in range(spec.n_layers):
        check_layer(source, spec, layer)
    requested = _requested_ranks(source, spec, opts, stats)
    plans = []
    for layer in range(spec.n_layers):
        ranks = exact = _exact_layer_ranks(source, spec, layer, opts)
        if requested is not None:
            ranks = _checked(requested[layer], exact, layer, spec, opts)
        shapes = output_shapes(spec, ranks, opts.layout, _biases(source, spec, layer))
        plans.append({"ranks": ranks, "shapes": shapes})
    return plans


def _calibration(source, spec: AttentionSpec, opts: ConvertOptions):
    """Input statistics of every layer on the calibration text (None when not needed)."""
    if not opts.lossy or opts.resolved_method == "svd":
        return None
    if spec.arch.hf_attention is None:
        raise ConvertError(
            f"--calib needs a transformers architecture to run; {spec.arch.name} has none: use --method svd"
        )
    config = source.config or {}
    ids = opts.calib
    if not isinstance(ids, torch.Tensor):
        root = getattr(source, "root", Path(opts.calib).parent)
        ids = text_token_ids(Path(opts.calib), root, config["vocab_size"], opts.calib_tokens, what="--calib")
    ids = ids[:, : opts.calib_tokens]
    if opts.resolved_method == "fisher":
        progress = _bar("calibrating (Fisher)", "window", opts.progress)
        return compress.fisher_calibrate(_whole_model(source, config), ids, progress=progress)
    return compress.calibrate(source, config, ids, spec.n_layers, progress=_bar("calibrating", "layer", opts.progress))


def _bar(desc: str, unit: str, progress: bool):
    """A progress bar over an iterable, shown on a terminal only (and never when quiet)."""
    return lambda items: tqdm(items, desc=desc, unit=unit, disable=None if progress else True)


def _whole_model(source, config: dict):
    """The original model in float32 on the CPU, for the Fisher method's backward pass."""
    from convert.verify.e2e import load_original

    model = load_original(source, config, "cpu", torch.float32)
    model.requires_grad_(False)
    return model


def _mla_section(spec: AttentionSpec, opts: ConvertOptions, infos: list[LayerInfo], plans: list[dict]) -> dict:
    layers = []
    for info, plan in zip(infos, plans):
        entry = info.to_config()
        entry["bias"] = sorted(name[: -len(".bias")] for name in plan["shapes"] if name.endswith(".bias"))
        layers.append(entry)
    notes = sorted({note for info in infos for note in info.notes})
    return {
        "format_version": FORMAT_VERSION,
        "converter": f"convert {__version__}",
        "source_architecture": spec.arch.name,
        "layout": opts.layout,
        "latent": opts.latent,
        "head_map": spec.head_map,
        "n_layers": spec.n_layers,
        "hidden_size": spec.hidden_size,
        "n_heads": spec.n_heads,
        "n_kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "softmax_scale": spec.softmax_scale,
        "rope": spec.arch.rope if spec.rope else None,
        "causal": spec.arch.causal,
        "layer_prefix": spec.layer_prefix_template,
        "layers": layers,
        "notes": notes,
        "compression": _compression_section(spec, opts, plans),
    }


def _compression_section(spec: AttentionSpec, opts: ConvertOptions, plans: list[dict]) -> dict | None:
    """How a lossy conversion spent its cache budget (None when exact)."""
    if not opts.lossy:
        return None
    gqa = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim
    achieved = sum(_cache_dims(p["ranks"]) for p in plans)
    calib = (
        opts.calib if opts.calib is None or isinstance(opts.calib, (str, Path)) else f"{opts.calib.shape[-1]} token ids"
    )
    return {
        "method": opts.resolved_method,
        "allocation": opts.resolved_allocation if opts.rank is None else "uniform",
        "kv_cache_ratio": opts.kv_cache_ratio,
        "rank": opts.rank,
        "budget_dims": None
        if opts.kv_cache_ratio is None
        else compress.budget_dims(opts.kv_cache_ratio, spec.n_layers, spec.n_kv_heads, spec.head_dim),
        "cache_dims": achieved,
        "gqa_cache_dims": gqa,
        "achieved_ratio": achieved / gqa,
        "calib": None if calib is None else str(calib),
        "calib_tokens": opts.calib_tokens if calib is not None else None,
    }


def _cache_dims(ranks: dict[str, int]) -> int:
    return ranks.get("rank_kv", 0) + ranks.get("rank_k", 0) + ranks.get("rank_v", 0)


def _sizes(source, spec: AttentionSpec, plans: list[dict], dtype: torch.dtype) -> dict:
    itemsize = torch.empty((), dtype=dtype).element_size()
    before = sum(
        math.prod(source.shape(n)) for layer in range(spec.n_layers) for n in attention_names(source, spec, layer)
    )
    after = sum(math.prod(s) for plan in plans for s in plan["shapes"].values())
    gqa_dims = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim
    mla_dims = sum(_cache_dims(plan["ranks"]) for plan in plans)
    return {
        "attention_params_before": before,
        "attention_params_after": after,
        "attention_bytes_before": before * itemsize,
        "attention_bytes_after": after * itemsize,
        "kv_cache_dims_per_token_before": gqa_dims,
        "kv_cache_dims_per_token_after": mla_dims,
        "kv_cache_bytes_per_token_before": gqa_dims * itemsize,
        "kv_cache_bytes_per_token_after": mla_dims * itemsize,
        "dtype": str(dtype).removeprefix("torch."),
    }


# ------------------------------------------------------------------ converting


def _convert_layers(source, spec, opts, plans, stats, sink, dtype, progress: bool) -> list[LayerInfo]:
    """Convert layer by layer, handing each output tensor (cast to `dtype`) to `sink`."""
    infos = []
    for layer in _bar("converting", "layer", progress)(range(spec.n_layers)):
        weights = read_layer(source, spec, layer)
        weighting = _weighting(weights, spec, opts, stats, layer)
        tensors, info = convert_layer(weights, spec, opts.latent, opts.layout, plans[layer]["ranks"], weighting)
        prefix = spec.prefix(layer)
        for name in plans[layer]["shapes"]:
            sink(prefix + name, tensors[name].to(dtype).contiguous())
        infos.append(info)
    return infos


def _attention_dtype(source, spec: AttentionSpec) -> torch.dtype:
    return source.dtype(spec.tensor(0, "q"))


def convert_state_dict(state_dict: dict[str, torch.Tensor], config, **options) -> MLAStateDict:
    """Convert an in-memory GQA state dict; nothing touches disk.

    config: the model's config (a transformers config or a dict; None for a
    bare seed-notation state dict with `arch="seed", n_heads=...`). options:
    the fields of `ConvertOptions` (output and verification fields are ignored).
    Returns the MLA state dict (attention tensors replaced, the rest shared);
    its `.config` is the output config with the `mla` section.
    """
    opts = ConvertOptions.from_kwargs(**options)
    config = config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)
    source = StateDictSource(state_dict, config)
    spec = _spec(source, config, opts)
    stats = _calibration(source, spec, opts)
    plans = _plan_layers(source, spec, opts, stats)
    dtype = _attention_dtype(source, spec)
    replaced = {n for layer in range(spec.n_layers) for n in attention_names(source, spec, layer)}
    result = MLAStateDict((k, v) for k, v in state_dict.items() if k not in replaced)
    result.layers = _convert_layers(source, spec, opts, plans, stats, result.__setitem__, dtype, progress=False)
    result.config = {**(config or {}), "mla": _mla_section(spec, opts, result.layers, plans)}
    return result


# ------------------------------------------------------------------ files


def default_output(src: Path) -> Path:
    """`<name>-mla` beside the input: ckpt.safetensors -> ckpt-mla/, model_dir -> model_dir-mla/."""
    src = Path(src)
    name = src.stem if src.is_file() else src.name
    return src.resolve().parent / f"{name}-mla"


def _check_output(src: Path, output: Path) -> None:
    src_r, out_r = src.resolve(), output.resolve()
    if out_r == src_r or out_r in src_r.parents:
        raise ConvertError(
            f"output {output} is the input or contains it; converting would overwrite the source: choose another -o"
        )


def _output_plan(source: Checkpoint, spec: AttentionSpec, plans: list[dict], dtype: torch.dtype) -> tuple[dict, set]:
    replaced = {n for layer in range(spec.n_layers) for n in attention_names(source, spec, layer)}
    plan = {}
    for name in source.keys():
        if name not in replaced:
            plan[name] = (source.shape(name), source.dtype(name))
    for layer, layer_plan in enumerate(plans):
        for name, shape in layer_plan["shapes"].items():
            plan[spec.prefix(layer) + name] = (shape, dtype)
    return plan, replaced


def _copy_aux_files(source: Checkpoint, writer: CheckpointWriter) -> None:
    if not source.path.is_dir():
        return
    for name in AUX_FILES:
        if (source.root / name).is_file():
            shutil.copyfile(source.root / name, writer.tmp_dir / name)


def gqa2mla(src, output=None, **options) -> ConversionResult:
    """Convert a GQA checkpoint into an MLA checkpoint directory, then verify it.

    src: a .safetensors file, a sharded directory (model.safetensors.index.json)
    or a Hugging Face model directory. output: the directory to create (default
    `<name>-mla` beside the input); written to a temporary sibling and renamed
    only when complete. options: the fields of `ConvertOptions`.

    Raises ConvertError for bad input (nothing is left on disk). A verification
    FAIL does not raise: the output is kept with its report; check `.passed`.
    """
    opts = ConvertOptions.from_kwargs(**options)
    opts.check_verifiable()
    timings: dict[str, float] = {}
    start = time.perf_counter()
    src = Path(src)
    output = Path(output) if output is not None else default_output(src)
    with open_checkpoint(src) as source:
        _check_output(src, output)
        spec = _spec(source, source.config, opts)
        stats = _calibration(source, spec, opts)
        plans = _plan_layers(source, spec, opts, stats)
        dtype = _attention_dtype(source, spec)
        plan, replaced = _output_plan(source, spec, plans, dtype)
        timings["plan_s"] = time.perf_counter() - start
        metadata = {"format": "pt", "mla_format_version": str(FORMAT_VERSION)}
        with CheckpointWriter(output, plan, parse_size(opts.max_shard_size), opts.force, metadata) as writer:
            t0 = time.perf_counter()
            for name in source.keys():
                if name not in replaced:
                    writer.write_raw(name, source.raw_bytes(name))
            infos = _convert_layers(source, spec, opts, plans, stats, writer.write, dtype, opts.progress)
            config = {**(source.config or {}), "mla": _mla_section(spec, opts, infos, plans)}
            writer.write_json("config.json", config)
            _copy_aux_files(source, writer)
            timings["convert_s"] = time.perf_counter() - t0
            sizes = _sizes(source, spec, plans, dtype)
            report = None
            if opts.verify:
                report = _verify_into(writer, src, opts, timings)
            final = writer.commit()
    timings["total_s"] = time.perf_counter() - start
    notes = config["mla"]["notes"]
    return ConversionResult(final, config, infos, sizes, timings, report, notes)


def _verify_into(writer: CheckpointWriter, src: Path, opts: ConvertOptions, timings: dict) -> dict:
    """Verify the not-yet-committed output and write its report beside the weights."""
    from convert.verify import verify, write_report

    t0 = time.perf_counter()
    report = verify(src, writer.tmp_dir, opts)
    report["inputs"]["converted"]["path"] = str(writer.output)  # where it will be once committed
    timings["verify_s"] = time.perf_counter() - t0
    write_report(report, writer.tmp_dir)
    return report
