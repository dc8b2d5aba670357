"""The `mla` target, this package's native format: plan the ranks, calibrate when compressing,
convert a layer at a time and stream the tensors to the writer (docs/math.md, "Absorption";
docs/design.md, "Compression" and "Output format"); loaded by `convert.load_mla_model` or, after `import convert`,
by transformers' Auto classes. The only target that compresses."""

import dataclasses

import torch

from convert import compress
from convert.arch import AttentionSpec
from convert.compress.refine import Refinement
from convert.compress.sequential import SequentialCalibration
from convert.errors import ConvertError
from convert.layouts import attention_view
from convert.mla.config import MLASection
from convert.mla.format import FORMAT_VERSION, output_config
from convert.mla.model import build_mla_model, load_mla_model
from convert.options import ConvertOptions
from convert.plan import ConversionPlan, check_rank, layer_weighting, make_plan, resolve_spec
from convert.progress import progress_bar
from convert.source import StateDictSource, read_layer
from convert.targets import Build
from convert.text import calibration_ids, fisher_ids
from convert.threads import in_order
from convert.transform import LayerInfo, convert_layer

NAME = "mla"
#: What other runtimes make of this output.
FOREIGN = (
    "stock transformers without `import convert` refuses its model type `convert_mla` (it never loads it as the "
    "source architecture with random attention); vLLM does not serve it: use --target vllm"
)


class MLAStateDict(dict):
    """The converted state dict; `.config` is the output config (with its `mla` section),
    `.plan` the conversion plan (sizes, ranks, cache)."""

    config: dict
    layers: list[LayerInfo]
    plan: ConversionPlan

    @property
    def mla(self) -> MLASection:
        """The output config's `mla` section, typed (what `convert.mla.build_mla_attention` takes)."""
        return MLASection.from_dict(self.config["mla"])


def check(spec: AttentionSpec, opts: ConvertOptions) -> None:
    """Nothing the native format cannot express: `resolve_spec` has refused what no layout can."""


def build(source, opts: ConvertOptions) -> Build:
    """Every refusal that needs no weights, calibration when compressing, then the converted
    tensors as a stream: the source's other tensors copied byte for byte, each layer's attention
    converted as the writer asks for it. `Build.config` is complete once the stream is consumed."""
    plan, stats, opts = _plan(source, source.config, opts, verifying=opts.verify)
    layers: list[LayerInfo] = []
    return Build(
        layout=plan.output_tensors(),
        copied=[name for name in source.keys() if name not in plan.replaced],
        tensors=layer_tensors(source, plan, opts, stats, layers),
        config=lambda: output_config(source.config, plan, opts, layers),
        notes=lambda: sorted({note for info in layers for note in info.notes}),
        sizes=plan.sizes,
        metadata={"format": "pt", "mla_format_version": str(FORMAT_VERSION)},
        options=opts,
        layers=layers,
        plan=plan,
    )


def state_dict(state: dict[str, torch.Tensor], config: dict | None, opts: ConvertOptions) -> MLAStateDict:
    """An in-memory GQA state dict converted (`convert.convert_state_dict`): attention tensors
    replaced, the rest the caller's own."""
    source = attention_view(StateDictSource(state, config), config)
    plan, stats, opts = _plan(source, config, opts, verifying=False)
    # the view's tensors: a Mixtral's stacked experts as its modules hold them, the rest the caller's own
    result = MLAStateDict((k, source.get(k)) for k in source.keys() if k not in plan.replaced)
    result.layers = []
    result.update(layer_tensors(source, plan, opts, stats, result.layers))
    result.config = output_config(config, plan, opts, result.layers)
    result.plan = plan
    return result


def model(state: dict[str, torch.Tensor], config: dict, opts: ConvertOptions, dtype: torch.dtype, device):
    """`to_mla`: the converted causal LM built from a live model's state dict, in its dtype and on its device."""
    converted = state_dict(state, config, opts)
    return build_mla_model(converted.config, converted, dtype=dtype, device=device)


def load(path, device, dtype):
    """A converted directory as `convert.load_mla_model` loads it."""
    return load_mla_model(path, device=device, dtype=dtype)


def _plan(source, config: dict | None, opts: ConvertOptions, verifying: bool):
    """Spec, calibration (when compressing with real inputs) and the plan built from them:
    (plan, stats, options as resolved: an explicit exact --rank is the exact conversion).

    Every refusal that needs no weights comes first, before calibration's work.
    """
    spec = resolve_spec(source, config, opts)
    opts = check_rank(source, spec, opts)
    if opts.lossy and opts.method is None and spec.arch.hf_attention is None:
        opts = dataclasses.replace(opts, method="svd")  # no model to run text through: weight SVD, as documented
    if verifying:
        opts.check_verifiable()
    stats = _calibration(source, spec, opts)
    if stats is not None:  # the refinement's steps and queries as sized for this device, recorded in the config
        refinement = Refinement.sized(opts.refine_steps, opts.refine_queries)
        opts = dataclasses.replace(opts, refine_steps=refinement.steps, refine_queries=refinement.queries)
    return make_plan(source, spec, opts, stats), stats, opts


def _calibration(source, spec: AttentionSpec, opts: ConvertOptions):
    """Input statistics of every layer on the calibration text (None when not needed)."""
    if not opts.lossy or opts.resolved_method == "svd":
        return None
    if spec.arch.hf_attention is None:
        raise ConvertError(
            f"--method {opts.resolved_method} runs calibration text through the model; {spec.arch.name} has no "
            "transformers architecture to run: use --method svd"
        )
    config = source.config or {}
    source = getattr(source, "module_source", source)  # as the original model's modules read it (Phi-3: unsplit)
    ids = calibration_ids(source, opts)
    if opts.resolved_method == "fisher":  # one decoder layer at a time, forward then backward, on the first tokens
        bar = progress_bar("calibrating (Fisher)", "layer", opts.progress)
        return compress.fisher_calibrate_streamed(
            source, config, fisher_ids(ids, opts.fisher_tokens), spec.n_layers, progress=bar
        )
    bar = progress_bar("calibrating", "layer", opts.progress)
    return compress.calibrate(source, config, ids, spec.n_layers, progress=bar)


def layer_tensors(source, plan: ConversionPlan, opts: ConvertOptions, stats, infos: list[LayerInfo]):
    """Convert layer by layer, yielding each output tensor (cast to the checkpoint's dtype) in layer
    order and appending each layer's `LayerInfo` to `infos`. Without sequential calibration, small
    layers are factored two at a time."""
    spec = plan.spec
    sequential = _sequential(source, plan, opts, stats)
    # The absorbed products come cast to the checkpoint's dtype (small), unless the sequential
    # calibration runs the layer next and wants them in float64.
    dtype = plan.dtype if sequential is None else torch.float64

    def convert_one(layer: int):
        weights = read_layer(source, spec, layer)
        weighting = layer_weighting(spec, opts, stats, weights, layer)
        if sequential is not None and opts.resolved_calibration == "sequential":
            weighting = _sequential_weighting(
                weighting, sequential.stats(layer), spec.rope and weights.k_bias is not None
            )
        return convert_layer(weights, spec, opts.latent, opts.layout, plan.layers[layer].ranks, weighting, dtype)

    workers = 1 if sequential is not None else plan.layer_workers()
    layers = progress_bar("converting", "layer", opts.progress)(range(spec.n_layers))
    for layer, (tensors, info) in zip(layers, in_order(convert_one, range(spec.n_layers), workers)):
        infos.append(info)
        if sequential is not None:
            mla = MLASection.from_dict(output_config(source.config, plan, opts, infos)["mla"])
            ran = sequential.advance(layer, mla, {name: tensors[name] for name in plan.layers[layer].shapes})
            if sequential.refinement.steps:  # the refined tensors are the conversion's
                tensors = ran
        prefix = spec.prefix(layer)
        for name in plan.layers[layer].shapes:
            yield prefix + name, tensors[name].to(plan.dtype).contiguous()
        del tensors  # before the next layer's: a bounded number of layers in memory


def _sequential(source, plan: ConversionPlan, opts: ConvertOptions, stats):
    """The two-stream calibration of `--calibration sequential` or of refinement (None when neither
    is asked or nothing is compressed)."""
    refinement = Refinement.sized(opts.refine_steps, opts.refine_queries)  # as _plan resolved it
    if stats is None or not opts.lossy or (opts.resolved_calibration != "sequential" and not refinement.steps):
        return None

    module_source = getattr(source, "module_source", source)
    ids = calibration_ids(module_source, opts)
    return SequentialCalibration(module_source, source.config or {}, ids, refinement=refinement)


def _sequential_weighting(weighting, layer_stats, affine_key: bool):
    """The layer's weighting with its input moments measured in the compressed model, and the cross
    moments that refit its up-projections to the original layer's outputs (Fisher rows unchanged)."""
    key_moment, key_cross = layer_stats.augmented() if affine_key else (layer_stats.moment, layer_stats.cross)
    if layer_stats.normed_keys is not None:  # q/k norm: the normed keys are what is compressed
        key_moment, key_cross = layer_stats.normed_keys
    weighting.key_moment, weighting.key_cross = key_moment, key_cross
    weighting.value_moment, weighting.value_cross = layer_stats.moment, layer_stats.cross
    return weighting
