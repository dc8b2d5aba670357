"""Target `vllm`: a DeepSeek-V3 checkpoint in the one shape vLLM's MLA kernels serve (512 latent + 64
shared rotary dims), behind the target interface (`convert.targets.Target`). The construction, file by
file: docs/design.md, "Deployment targets". Two entry points besides the interface: `vllm_export` (the
tensor stream) and `to_vllm_deepseek` (in memory)."""

import torch

from convert.arch import AttentionSpec
from convert.compress.refine import Refinement
from convert.errors import ConvertError
from convert.hf import load_pretrained
from convert.layouts import attention_view
from convert.source import LazyTensors, StateDictSource
from convert.targets import Build
from convert.targets.deepseek import check_deepseek, export_model, export_sizes, export_spec, exporting
from convert.targets.vllm.bias import biased_projections
from convert.targets.vllm.calibration import VLLM_CALIBRATION, export_statistics, latent_sequential
from convert.targets.vllm.export import ExportChoices, stream_export, to_vllm_deepseek, vllm_export
from convert.targets.vllm.geometry import LATENT_DIMS, ROPE_DIM, needs_compression
from convert.targets.vllm.notes import NAME, report, short_note
from convert.targets.vllm.rope import check_vllm_exportable, needs_calibration
from convert.targets.vllm.runtime import match_vllm_norms
from convert.text import calibration_ids

__all__ = [
    "FOREIGN",
    "NAME",
    "VLLM_CALIBRATION",
    "ExportChoices",
    "build",
    "check",
    "export_choices",
    "export_statistics",
    "latent_sequential",
    "load",
    "match_vllm_norms",
    "model",
    "report",
    "to_vllm_deepseek",
    "vllm_export",
]

#: What other runtimes make of this output.
FOREIGN = (
    "stock transformers runs it as a DeepseekV3ForCausalLM and computes the model vLLM serves (compare or "
    "evaluate there); to train it, use convert heal, which keeps frozen the biases vLLM ignores"
)


def check(spec: AttentionSpec, opts) -> None:
    """What DeepSeek-V3's dense layers cannot hold (q/k norms, fused MLPs); vLLM's own limits are
    checked with the export's geometry (`check_vllm_exportable`)."""
    check_deepseek(spec, NAME)


def build(source, opts) -> Build:
    """The export's tensors, read from the source a tensor at a time as they are written, calibrated
    on --calib when there is more than one key/value head. Every refusal comes before calibration."""
    layout, config, tensors, spec = _export(source, LazyTensors(source), opts)
    return Build(
        layout=layout,
        copied=[],
        tensors=exporting(tensors, len(layout), opts.progress),
        config=lambda: config,
        notes=lambda: [short_note(config["convert_export"]), FOREIGN],  # complete once every tensor is written
        sizes=lambda: export_sizes(source, spec, opts, layout, config),
        metadata={"format": "pt"},
        options=opts,
    )


def model(state: dict, config: dict, opts, dtype: torch.dtype, device):
    """`to_mla(target="vllm")`: the export as transformers' DeepseekV3ForCausalLM with vLLM's
    latent-norm eps (`match_vllm_norms`), in memory."""
    source = attention_view(StateDictSource(state, config), config)
    _, export_config, tensors, _ = _export(source, state, opts)
    export = export_model(dict(tensors), export_config, dtype, device, NAME)
    match_vllm_norms(export)
    return export


def load(path, device, dtype):
    """The export as transformers loads it, with vLLM's latent-norm eps: the model vLLM serves."""
    model = load_pretrained(path, device, dtype)
    match_vllm_norms(model)
    return model


def _export(source, state_dict, opts):
    """(layout, config_dict, tensor stream, spec) of `source`'s export: resolved and refused once (the
    conversion's refusals, then vLLM's), calibrated where it is lossy or --calib is given. state_dict:
    the source's tensors by name (read lazily from a checkpoint)."""
    config, view, spec = export_spec(state_dict, source.config or {}, NAME, opts)
    choices = export_choices(source, view, spec, config, opts, NAME)
    layout, export_config, tensors = stream_export(state_dict, config, view, spec, choices)
    return layout, export_config, tensors, spec


def export_choices(
    source,
    view,
    spec: AttentionSpec,
    config: dict,
    opts,
    target: str,
    dtype=None,
    rank: int = LATENT_DIMS,
    rope_dim: int = ROPE_DIM,
) -> ExportChoices:
    """The export's choices (the vllm construction's, shared by the llamacpp target): vLLM's refusals,
    then, where the export is lossy (`needs_calibration`, a compressed latent) or --calib is given, its
    calibration on --calib (the shipped mix when not given, as a compression's), tensors in `dtype`
    (None: the source's), the latent at most `rank` dims (compressed below the content's), one shared
    rotary key of `rope_dim` dims. A lossy export is judged by its perplexity ratio: --max-ppl-ratio is
    needed."""
    biased = biased_projections(spec, view)
    calibrate = needs_calibration(spec, config, bool(biased), rope_dim)
    compressed = needs_compression(spec, config["hidden_size"], rank, rope_dim)
    check_vllm_exportable(config, spec, view, dtype or view.dtype(spec.tensor(0, "q")), True, rope_dim)
    if (calibrate or compressed) and opts.verify and opts.max_ppl_ratio is None:
        raise ConvertError(
            f"--target {target} is lossy for this model (one {rope_dim}-dim rotary key shared by all heads, at one frequency "
            "set): verification judges it by the perplexity ratio on each kind of text (the shipped held-out text, "
            "and --text FILE when given), so pass --max-ppl-ratio R (e.g. 1.5), or --no-verify"
        )
    if opts.calib is None and not (calibrate or compressed):
        return ExportChoices(dtype=dtype, rank=rank, rope_dim=rope_dim)  # exact: nothing to calibrate
    ids = calibration_ids(source, opts)
    stats = export_statistics(
        source,
        config,
        view,
        spec,
        ids,
        fisher=compressed,
        lossy=calibrate,
        output_bias="o" in biased,
        progress=opts.progress,
        fisher_tokens=opts.fisher_tokens,
        rope_dim=rope_dim,
    )
    if not compressed:
        return ExportChoices(stats=stats, dtype=dtype, rank=rank, rope_dim=rope_dim)
    # each compressed layer fitted to its attention output, as the MLA layouts are (sized to the device)
    refinement = Refinement.sized(opts.refine_steps, opts.refine_queries)
    sequential = latent_sequential(source, config, ids, opts.calibration, refinement)
    return ExportChoices(
        stats=stats, dtype=dtype, rank=rank, sequential=sequential, shrinkage=opts.shrinkage, rope_dim=rope_dim
    )
