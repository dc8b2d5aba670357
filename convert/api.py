"""The Python API: read → plan → target → write → verify, for files and in memory. No click, no printing.

result = convert.gqa2mla("model_dir", "model_dir-mla")
mla_sd = convert.convert_state_dict(model.state_dict(), model.config)
mla_model = convert.to_mla(model)
"""

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from convert.errors import ConvertError
from convert.heap import release_freed_memory
from convert.io import Checkpoint, CheckpointWriter, default_output, model_files, open_checkpoint, output_lock
from convert.layouts import attention_view
from convert.mla.format import AUX_FILES
from convert.options import ConvertOptions, as_path
from convert.plan import ConversionPlan, make_plan, resolve_spec
from convert.sizes import parse_size
from convert.targets import TARGETS, Build, check_options, target
from convert.targets import mla as mla_target
from convert.targets.mla import MLAStateDict
from convert.transform import LayerInfo
from convert.verify import export_memory_cap, memory_run, plan_memory_cap, verify, write_report


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
    plan: ConversionPlan | None = None

    @property
    def passed(self) -> bool | None:
        return None if self.report is None else self.report["verdict"] == "PASS"


def _as_dict(config) -> dict | None:
    """A transformers config or a dict as a plain dict (None stays None: a bare seed state dict)."""
    return config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)


def convert_state_dict(state_dict: dict[str, torch.Tensor], config, **options) -> MLAStateDict:
    """Convert an in-memory GQA state dict; nothing touches disk.

    config: the model's config (a transformers config or a dict; None for a
    bare seed-notation state dict with `arch="seed", n_heads=...`). options:
    the fields of `ConvertOptions` (output and verification fields are ignored).
    Returns the MLA state dict (attention tensors replaced, the rest shared);
    its `.config` is the output config with the `mla` section.
    """
    opts = ConvertOptions.from_kwargs(**{"progress": False, **options})
    if not isinstance(state_dict, dict):
        raise ConvertError(
            f"state_dict: expected a dict of tensors (model.state_dict()), got {type(state_dict).__name__}"
        )
    return mla_target.state_dict(state_dict, _as_dict(config), opts)  # the native format's own entry point


def to_mla(model, **options):
    """Convert a live transformers GQA model in memory and return the MLA causal LM.

    model: a causal LM of a supported architecture (its `config` and `state_dict()`
    are read, nothing is changed). options: the fields of `ConvertOptions`, as for
    `gqa2mla` (layout, rank, kv_cache_ratio, method, calib as text paths or token
    ids (1, N), ...); output and verification fields do not apply. Returns the same
    module, with the same weights, as `load_mla_model` returns for the directory
    `gqa2mla` writes from this model: on the model's device, in its dtype, in eval
    mode, an `nn.Module` whose `forward(input_ids, labels=...)` gives the usual loss.
    With target="transformers" or "vllm" it is the export's DeepseekV3ForCausalLM, as
    `convert.verify.load_export` loads the directory `gqa2mla` writes (the vllm export
    with vLLM's latent-norm eps), to train or evaluate in memory; to serve healed weights,
    heal the written export (`heal(export_dir, ...)`). No disk is involved.
    """
    opts = ConvertOptions.from_kwargs(**{"progress": False, "verify": False, **options})  # nothing to verify here
    check_options(opts)
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise ConvertError(
            f"model={model!r:.60}: expected a transformers causal LM (an nn.Module with a .config), got "
            f"{type(model).__name__}; load one with transformers.AutoModelForCausalLM.from_pretrained"
        )
    parameter = next(model.parameters())
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return target(opts.target).model(state, _as_dict(model.config), opts, parameter.dtype, parameter.device)


def gqa2mla(src, output=None, **options) -> ConversionResult:
    """Convert a GQA checkpoint into an MLA checkpoint directory, then verify it.

    src: a .safetensors file, a sharded directory (model.safetensors.index.json)
    or a Hugging Face model directory. output: the directory to create (default
    `<name>-mla` beside the input); written to a temporary sibling and swapped
    into place only when complete. It must not be, contain or lie inside an
    input; an existing one is replaced only with `force=True` and only if
    convert wrote it (its `.convert-manifest.json`). options: the fields of
    `ConvertOptions`; `target` picks what is written (`convert.targets`).

    Raises ConvertError (exit 2) for bad input and EnvironmentFailure (exit 3)
    for disk, permission or lock problems; nothing is left on disk either way. A
    verification FAIL does not raise: the output is kept with its report; check
    `.passed`.
    """
    opts = ConvertOptions.from_kwargs(**options)
    check_options(opts)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    src = as_path("src", src)
    output = as_path("output", output) if output is not None else default_output(src)
    inputs = [src, opts.text, *opts.calib_paths]
    with memory_run(), open_checkpoint(src) as stored, output_lock(output, inputs, opts.force):
        source = attention_view(stored, stored.config)  # Phi-3: q/k/v split out of qkv_proj
        if opts.max_memory is not None and opts.target == "mla":  # refused before calibration and writing
            plan_memory_cap(_exact_plan(source, opts), stored.config or {}, opts)
        if opts.verify and TARGETS[opts.target].export:  # both whole models: refused before hours of converting
            export_memory_cap(stored, opts)
        build = target(opts.target).build(source, opts)  # every refusal first, then calibration
        opts = build.options
        timings["plan_s"] = time.perf_counter() - start
        with CheckpointWriter(output, build.layout, parse_size(opts.max_shard_size), opts.force, build.metadata) as w:
            t0 = time.perf_counter()
            _write(source, build, w)
            release_freed_memory()  # the conversion's freed layers, before verification builds its own
            config = build.config()
            final, report = _finish(w, source, src, config, opts, timings, t0)
    timings["total_s"] = time.perf_counter() - start
    return ConversionResult(final, config, build.layers, build.sizes(), timings, report, build.notes(), build.plan)


def _exact_plan(source, opts: ConvertOptions) -> ConversionPlan:
    """The exact conversion's plan (a compression's tensors are no larger): what --max-memory is
    checked against before any calibration or writing."""
    exact = dataclasses.replace(opts, kv_cache_ratio=None, rank=None)
    return make_plan(source, resolve_spec(source, source.config, exact), exact)


def _write(source: Checkpoint, build: Build, writer: CheckpointWriter) -> None:
    """The tensors copied through (file to file where the source stores them whole), then the
    target's own stream, each written as it comes."""
    for name in build.copied:
        span = source.raw_span(name)  # None: assembled in memory (Mixtral's stacked experts)
        if span is not None:
            writer.copy_span(name, *span)
        else:
            writer.write_chunks(name, source.raw_chunks(name))
    for name, tensor in build.tensors:
        writer.write(name, tensor)
    if build.extra is not None:
        build.extra(writer.tmp_dir)


def _copy_aux_files(source: Checkpoint, writer: CheckpointWriter) -> None:
    for name, data in model_files(source.path).items():  # a GGUF's tokenizer, as a directory's files
        writer.write_file(name, data)
    if not source.path.is_dir():
        return
    for name in AUX_FILES:
        if (source.root / name).is_file():
            writer.copy_file(name, source.root / name)


def _finish(writer: CheckpointWriter, source: Checkpoint, src: Path, config: dict, opts, timings: dict, t0: float):
    """config.json and the model directory's other files, verification, then the atomic commit.
    Returns (the committed output directory, the report or None)."""
    writer.write_json("config.json", config)
    _copy_aux_files(source, writer)
    writer.flush()  # the writer thread has copied what it reads from the source
    timings["convert_s"] = time.perf_counter() - t0
    source.close()  # its mapped pages leave memory; verification opens the checkpoint again
    report = _verify_into(writer, src, opts, timings) if opts.verify else None
    return writer.commit(), report


def _verify_into(writer: CheckpointWriter, src: Path, opts: ConvertOptions, timings: dict) -> dict:
    """Verify the not-yet-committed output and write its report beside the weights."""
    t0 = time.perf_counter()
    writer.write_index()  # a sharded output must open as a checkpoint before it is committed
    report = verify(src, writer.tmp_dir, opts)
    report["inputs"]["converted"]["path"] = str(writer.output)  # where it will be once committed
    timings["verify_s"] = time.perf_counter() - t0
    write_report(report, writer.tmp_dir)
    return report
