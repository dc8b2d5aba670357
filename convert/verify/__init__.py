"""Verification: does the converted checkpoint compute what the original computed?

`verify_paths(original, converted, **options)` returns the report (a dict, see
`convert.verify.report` for its schema); `write_report` writes it as JSON,
Markdown and a PNG. docs/design.md, "Verification", is the contract.
"""

import dataclasses
import hashlib
import json
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import transformers

from convert._version import __version__
from convert.errors import ConvertError
from convert.heap import large_allocations_mapped, release_freed_memory
from convert.hf import source_fields
from convert.io import open_checkpoint
from convert.layouts import module_layout
from convert.mla.config import MLASection
from convert.mla.model import load_mla_model, read_mla_config
from convert.options import VerifyOptions, dtype_name
from convert.progress import phase, progress
from convert.sizes import gib
from convert.targets import TARGETS, ExportTarget, load_output, output_target, written_by
from convert.text import judging_ids, model_tokenizer, text_token_ids
from convert.verify.decision import check, coarsest, decide, thresholds
from convert.verify.e2e import GREEDY_NEW, GREEDY_PROMPT, end_to_end, greedy_in_turn, streamed_end_to_end
from convert.verify.foreign import open_export
from convert.verify.layers import check_hf_layers, check_seed_layers
from convert.verify.memory import (
    MemoryCap,
    memory_cap,
    memory_run,
    one_model_memory_bytes,
    process_peak_bytes,
    stored_layers,
    streamed_verify_memory_bytes,
    whole_model_activation_bytes,
    whole_model_memory_bytes,
)
from convert.verify.report import render_markdown, write_report
from convert.verify.run import VerifyRun
from convert.verify.streamed import greedy_streamed
from convert.verify.twin import twin_view

__all__ = [
    "export_memory_cap",
    "memory_run",
    "plan_memory_cap",
    "render_markdown",
    "verify",
    "verify_paths",
    "write_report",
]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(checkpoint) -> dict:
    """The checkpoint's path, its files' digests and, where its values are not the stored ones (a
    quantized GGUF, dequantized), what they are."""
    found = {"path": str(checkpoint.path), "files": {f.name: _sha256(f) for f in checkpoint.files}}
    description = getattr(checkpoint, "description", None)
    return found | ({"description": description} if description else {})


def _versions() -> dict:
    return {
        "convert": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class _Findings:
    """What a verification run found, for the report: per-layer and end-to-end figures (or why the
    latter did not run), checks besides them, the inputs' checksums and every phase's seconds."""

    layers: list[dict]
    e2e: dict | None
    skipped: str | None
    inputs: dict
    timings: dict
    checks: tuple[dict, ...] = ()


class _Timings(dict):
    """Seconds per phase (`with timings("layers"):` adds to "layers_s"); `close` adds what no phase took
    as "other_s" and the whole as "total_s", so that every second of a run is in the report."""

    def __init__(self):
        super().__init__()
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[f"{phase}_s"] = self.get(f"{phase}_s", 0.0) + time.perf_counter() - t0

    def close(self) -> dict:
        total = time.perf_counter() - self.start
        return {**self, "other_s": max(total - sum(self.values()), 0.0), "total_s": total}


def verify_paths(original, converted, **options) -> dict:
    """Verify the MLA directory `converted` against the GQA checkpoint `original`.

    options: the fields of `VerifyOptions` (text, tokens, device, dtype,
    max_ppl_ratio, progress). Per layer always; end to end (logits, KL, top-1,
    perplexity, greedy generation, cache bytes) when the architecture is a
    transformers causal LM and both models fit in memory. A half-precision exact
    conversion is held to the noise floor of the original's equivalent twin
    (`convert.verify.twin`), measured alongside. Returns the report dict.
    """
    return verify_with(original, converted, VerifyOptions.from_kwargs(**options))


def verify_with(original, converted, opts: VerifyOptions) -> dict:
    """`verify_paths` with its options already parsed (what a conversion hands on), within its memory
    cap (`convert.verify.memory.memory_cap`: --max-memory, or the default counted from the resident
    memory when the run began), large allocations mapped on their own (`large_allocations_mapped`)."""
    with memory_run(), large_allocations_mapped():
        return _verify_with(original, converted, opts)


def _verify_with(original, converted, opts: VerifyOptions) -> dict:
    if is_export(converted):
        return _verify_export(original, converted, opts)
    text, tokens, max_ppl_ratio = opts.text, opts.tokens, opts.max_ppl_ratio
    timings = _Timings()
    run_device = opts.torch_device
    config, mla = read_mla_config(converted)
    if opts.calibrated_on is None:  # a separate `convert verify`: what the conversion recorded
        calib = ((config.get("mla") or {}).get("compression") or {}).get("calib")
        opts = dataclasses.replace(opts, calibrated_on=calib if isinstance(calib, list) else None)
    with open_checkpoint(original) as stored, open_checkpoint(converted) as conv:
        orig = module_layout(stored, config)  # Mixtral: experts stacked, as the converted checkpoint holds them
        _check_same_source(orig, config, converted)
        with timings("copied_tensors"), phase("comparing the copied tensors", opts.progress):
            copied = copied_tensors_check(orig, conv, mla)
        ckpt_dtype = conv.dtype(next(k for k in conv.keys() if "self_attn" in k or "W_" in k or "_down" in k))
        run_dtype = opts.run_dtype(ckpt_dtype)
        limits = thresholds(coarsest(run_dtype, ckpt_dtype), max_ppl_ratio)
        twin = twin_view(orig, config) if limits["noise_floor"] else None
        run = VerifyRun(orig, conv, config, run_device, run_dtype, twin, ckpt_dtype, mla)
        runnable = mla.source_architecture != "seed"
        with timings("tokens"):
            ids, segments = _judged_ids(text, orig, config, tokens, runnable, limits)
        # the per-layer check (information when lossy) runs on the first text, --tokens long, as when exact
        layer_ids = None if ids is None or not (text or segments) else ids[:, :tokens]
        cap = _memory_cap(opts, run, tokens if ids is None else ids.shape[-1])  # refused here, before any check
        bar = lambda it: progress(it, "verifying", "layer", opts.progress)
        with timings("layers"):
            layers = check_hf_layers(run, layer_ids, tokens, bar) if runnable else check_seed_layers(run, tokens, bar)
        release_freed_memory()  # the per-layer check's freed modules, before the end-to-end part
        e2e, skipped = None, "the source architecture has no transformers causal LM" if not runnable else None
        if runnable:
            with timings("end_to_end"), phase("end-to-end check", opts.progress):
                e2e = _end_to_end(opts, run, converted, ids, cap, segments)
        with timings("checksums"), phase("checksums of the inputs", opts.progress):
            inputs = {"original": _files(orig), "converted": _files(conv), "text": _text_input(text, ids, segments)}
    found = _Findings(layers, e2e, skipped, inputs, timings.close(), (copied,))
    return _report(opts, run_dtype, limits, found, cap)


def _end_to_end(opts: VerifyOptions, run: VerifyRun, converted, ids, cap: MemoryCap, segments=None) -> dict:
    """The end-to-end figures: both whole models at once (--e2e whole, or auto when the room under the
    memory cap and the free memory, less a margin, holds them), else streamed a decoder layer at a
    time, with (auto) greedy generation from each whole model in turn when one fits, else streamed
    as well; the twin's as the `floor` when there is one. converted: the converted directory (greedy
    generation loads it whole); segments: the texts `ids` holds, each judged on its own (`by_text`)."""
    orig, conv, config, device = run.original, run.converted, run.config, run.device
    tokenizer = model_tokenizer(orig.root)
    if opts.e2e == "whole" or (opts.e2e == "auto" and _whole_models_fit(run, ids, cap)):
        load = lambda device, dtype: load_mla_model(converted, device=device, dtype=dtype)
        return end_to_end(run, load, ids, tokenizer, segments)
    greedy, why = None, "greedy generation needs a whole model with a KV cache, and --e2e streamed keeps to one layer"
    if opts.e2e == "auto":
        assert run.ckpt_dtype is not None  # `_verify_with` sets it
        greedy_dtype = opts.greedy_dtype(run.ckpt_dtype)
        fits, need = _one_model_fits(orig, conv, device, greedy_dtype, cap)
        if fits:
            greedy = greedy_in_turn(orig, converted, config, ids, device, greedy_dtype)
        else:  # the same tokens, one decoder layer in memory at a time: a pass over the checkpoints per token
            single = dataclasses.replace(run, dtype=greedy_dtype, twin=None)
            eos = config.get("eos_token_id")
            eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
            ref, got = greedy_streamed(single, ids.to(device), GREEDY_PROMPT, GREEDY_NEW, eos)
            greedy = (ref, got, greedy_dtype, f"streamed: one whole model does not fit ({need})")
    return streamed_end_to_end(run, ids, greedy, why, tokenizer, segments)


def _check_same_source(orig, config: dict, converted) -> None:
    """ORIGINAL must be the model CONVERTED was made from: the converted config.json keeps the
    source's fields verbatim (under its own model type), so any difference is a wrong pair
    or a damaged directory. Refused before any model is built."""
    if orig.config is None:
        return  # a bare safetensors file: the tensors' shapes are checked as the layers load
    ours, theirs = source_fields(config), source_fields(orig.config)
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            raise ConvertError(
                f"{Path(converted) / 'config.json'}: {key}={ours.get(key)!r} but the original's config.json has "
                f"{theirs.get(key)!r}; ORIGINAL is not the model CONVERTED was made from (or one was edited): "
                "pass the right pair, or re-convert"
            )


def _same_bytes(orig, conv, name: str) -> bool:
    """Whether tensor `name` is stored with the same bytes in both, compared piece by piece."""
    if tuple(orig.shape(name)) != tuple(conv.shape(name)) or orig.dtype(name) != conv.dtype(name):
        return False
    ours, theirs = orig.raw_chunks(name), conv.raw_chunks(name)  # pieces may differ in size
    a = b = memoryview(b"")
    while True:
        a = a if len(a) else memoryview(next(ours, b"") or b"")
        b = b if len(b) else memoryview(next(theirs, b"") or b"")
        if not len(a) or not len(b):
            return not len(a) and not len(b)
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            return False
        a, b = a[n:], b[n:]


def copied_tensors_check(orig, conv, mla: MLASection) -> dict:
    """Every tensor outside attention is copied byte for byte: compare each with the original's."""
    prefixes = tuple(mla.prefix(i) for i in range(mla.n_layers))
    names = [n for n in conv.keys() if n in orig and not (prefixes and n.startswith(prefixes))]
    differ = [n for n in names if not _same_bytes(orig, conv, n)]
    failure = f"{len(differ)} tensor(s) copied from the original differ from it, e.g. {differ[0]!r}" if differ else ""
    return check(
        "tensors copied from the original, byte for byte",
        f"{len(names) - len(differ)}/{len(names)}",
        "all",
        not differ,
        failure,
    )


def is_export(directory) -> bool:
    """Whether `directory` holds an export target's checkpoint (not the native MLA format)."""
    config = Path(directory) / "config.json"
    try:
        name = written_by(json.loads(config.read_text()))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return False  # the native checks say what is wrong with it
    entry = None if name is None else TARGETS.get(name)
    return entry is not None and entry.export


def _verify_export(original, exported, opts: VerifyOptions) -> dict:
    """End-to-end verification of an export target (a DeepseekV3ForCausalLM), loaded by stock
    transformers as a user would. No per-layer part: its layers are not MLAAttention modules.
    Bounds are no finer than float32: DeepseekV3RMSNorm computes in float32."""
    timings = _Timings()
    device = opts.torch_device
    with open_checkpoint(original) as orig, open_export(exported) as conv:
        config = orig.config or {}
        ckpt_dtype = _export_dtype(conv)
        dtype = opts.run_dtype(ckpt_dtype)
        limits = thresholds(coarsest(dtype, ckpt_dtype, torch.float32), opts.max_ppl_ratio)
        with timings("tokens"):
            ids, segments = _judged_ids(opts.text, orig, config, opts.tokens, True, limits)
        cap = _export_memory_cap(orig, dtype, opts)
        export = (conv.config or {}).get("convert_export", {})
        twin = twin_view(orig, config) if limits["noise_floor"] else None
        run = VerifyRun(orig, conv, config, device, dtype, twin, ckpt_dtype)
        load = lambda device, dtype: load_export(exported, device, dtype)
        with timings("end_to_end"), phase("end-to-end check", opts.progress):
            e2e = end_to_end(run, load, ids, model_tokenizer(orig.root), segments)
        with timings("checksums"), phase("checksums of the inputs", opts.progress):
            inputs = {
                "original": _files(orig),
                "converted": _files(conv),
                "text": _text_input(opts.text, ids, segments),
            }
    report = _report(opts, dtype, limits, _Findings([], e2e, None, inputs, timings.close()), cap)
    section = cast(ExportTarget, output_target(conv.config or {})).report(export, e2e, ckpt_dtype)  # `is_export`
    if section is not None:
        report["target"] = section
    return report


def export_memory_cap(source, opts) -> MemoryCap:
    """The memory cap of verifying an export of `source` (an open checkpoint), checked before converting:
    refused (ConvertError, exit 2) where both whole models will not fit even in the least the verification
    can run in (float32, or --dtype), as `_verify_export` would refuse them after the conversion (an export
    may be written in another dtype than the source's, which sets the run's: a lower bound refuses nothing
    that check would accept)."""
    return _export_memory_cap(source, opts.run_dtype(torch.bfloat16), opts)


def _export_memory_cap(orig, dtype: torch.dtype, opts) -> MemoryCap:
    """The cap for both whole models of an export's verification in `dtype`; refused where they do not fit."""
    needed = whole_model_memory_bytes(orig.total_bytes(), orig.dtype(orig.keys()[0]), dtype)
    cap = memory_cap(opts.max_memory_bytes, orig.total_bytes(), needed, "verifying an export (both whole models)")
    fits, why = _within(needed, opts.torch_device, cap)
    if not fits:
        raise ConvertError(f"verifying an export loads both whole models, which do not fit ({why}); use --no-verify")
    return cap


def _export_dtype(conv) -> torch.dtype:
    """The export's tensor dtype: its first tensor's, or (weights in a file of another format: the
    llamacpp target's GGUF) the one its config.json names."""
    if conv.keys():
        return conv.dtype(conv.keys()[0])
    return getattr(torch, (conv.config or {}).get("dtype") or "float32")


def load_export(path, device="cpu", dtype=None):
    """An export as the runtime it was made for computes it (`convert.targets.load_output`): stock
    transformers, a vllm export with vLLM's latent-norm eps."""
    return load_output(path, device, dtype)


def _report(opts: VerifyOptions, run_dtype, limits: dict, found: _Findings, cap: MemoryCap) -> dict:
    """The report dict (schema in convert.verify.report); run_dtype: the run's (`--dtype auto` resolved)."""
    decision = decide(found.layers, found.e2e, limits, found.checks)
    device = opts.torch_device
    return {
        "schema": "convert.verification/1",
        "verdict": decision["verdict"],
        "decision": decision,
        "failures": decision["failures"],
        "thresholds": limits,
        "layers": found.layers,
        "end_to_end": found.e2e,
        "end_to_end_skipped": found.skipped,
        "inputs": found.inputs,
        "options": {
            "text": str(opts.text) if opts.text else None,
            "tokens": opts.tokens,
            "device": opts.device,
            "dtype": opts.dtype,
            "max_ppl_ratio": opts.max_ppl_ratio,
            "calibrated_on": opts.calibrated_on,
            "e2e": opts.e2e,
            "max_memory": opts.max_memory_bytes,
        },
        "memory": cap.to_report(process_peak_bytes()),
        "versions": _versions(),
        "device": {
            "type": device.type,
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        },
        "dtype": dtype_name(run_dtype),
        "timings": found.timings,
    }


def _one_model_fits(orig, conv, device: torch.device, dtype: torch.dtype, cap: MemoryCap) -> tuple[bool, str]:
    """Whether the larger of the two whole models, in `dtype`, fits in the room left (`_within`), and if not, why."""
    needed = max(one_model_memory_bytes(c.total_bytes(), c.dtype(c.keys()[0]), dtype) for c in (orig, conv))
    return _within(needed, device, cap)


def _whole_models_bytes(run: VerifyRun, tokens: int) -> int:
    """Both whole models in the run's dtype and the whole-model run's logits."""
    checkpoints = (run.original, run.converted)
    models = sum(one_model_memory_bytes(c.total_bytes(), c.dtype(c.keys()[0]), run.dtype) for c in checkpoints)
    return models + whole_model_activation_bytes(tokens, run.config["vocab_size"])


def _whole_models_fit(run: VerifyRun, ids, cap: MemoryCap) -> bool:
    """Whether both whole models and their logits fit in the room left (`_within`): then --e2e auto
    verifies them whole, greedy generation included."""
    return _within(_whole_models_bytes(run, ids.shape[-1]), run.device, cap)[0]


def _within(needed: int, device: torch.device, cap: MemoryCap) -> tuple[bool, str]:
    """Whether `needed` bytes fit in the room left on `device` (`MemoryCap.room`: under the cap, and
    the memory free less a margin); the figures, when not."""
    room, words = cap.room(device)
    return needed <= room, f"it needs ~{gib(needed)}, more than {words}"


def plan_memory_cap(plan, config: dict, opts) -> MemoryCap:
    """A conversion's memory cap, decided before anything is written (refused, exit 2, where --max-memory
    cannot hold it): the larger of the streamed conversion (`ConversionPlan.conversion_memory_bytes`)
    and, unless --no-verify, its verification streamed one decoder layer at a time. plan: the native
    target's `ConversionPlan`; config: the source's config.json."""
    needed, what = plan.conversion_memory_bytes(), "this conversion"
    if opts.verify:
        stored = stored_layers(plan.source_tensors, plan.output_tensors(), plan.spec.n_layers)
        verify_bytes = streamed_verify_memory_bytes(stored, config, opts.run_dtype(plan.dtype), opts.tokens)
        if verify_bytes > needed:
            needed, what = verify_bytes, "this conversion's verification streamed one decoder layer at a time"
    return memory_cap(opts.max_memory_bytes, plan.checkpoint_bytes, needed, what)


def _memory_cap(opts: VerifyOptions, run: VerifyRun, tokens: int) -> MemoryCap:
    """The run's memory cap (`convert.verify.memory.memory_cap`), refused when it cannot hold the least
    this verification needs: one decoder layer of each model at a time (streamed), or with --e2e
    whole both whole models."""
    orig, conv = run.original, run.converted
    assert run.mla is not None  # a native run (an export's cap is `_export_memory_cap`)
    if opts.e2e == "whole":
        needed, what = _whole_models_bytes(run, tokens), "--e2e whole (both whole models at once)"
    else:
        shapes = lambda c: {n: (tuple(c.shape(n)), c.dtype(n)) for n in c.keys()}
        stored = stored_layers(shapes(orig), shapes(conv), run.mla.n_layers)
        what = "the verification of this model streamed one decoder layer at a time"
        if run.mla.source_architecture == "seed":  # the per-layer check alone: a layer's modules in the run's dtype
            needed = stored.layer_bytes * run.dtype.itemsize // stored.dtype.itemsize + stored.tensor_bytes
        else:
            needed = streamed_verify_memory_bytes(stored, run.config, run.dtype, tokens)
    return memory_cap(opts.max_memory_bytes, orig.total_bytes(), needed, what)


def _token_ids(text, orig, config: dict, tokens: int, runnable: bool) -> torch.Tensor | None:
    if not runnable:
        return None
    vocab = config["vocab_size"]
    if text:
        return text_token_ids(Path(text), orig.root, vocab, tokens)
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))


def _judged_ids(text, orig, config: dict, tokens: int, runnable: bool, limits: dict) -> tuple:
    """(token ids (1, N) or None, segments or None): what the run is checked on. An exact conversion:
    --text's first `tokens` (or random ones). A lossy one (judged by perplexity): --text's (when
    given) then the shipped held-out text of every kind (`convert.text.judging_ids`), `tokens` each,
    one after the other; segments [(name, tokens), ...] name them, each judged on its own."""
    if not runnable or limits["max_ppl_ratio"] is None:
        return _token_ids(text, orig, config, tokens, runnable), None
    vocab = config["vocab_size"]
    parts = {f"--text {Path(text).name}": text_token_ids(Path(text), orig.root, vocab, tokens)} if text else {}
    parts |= judging_ids(orig.root, vocab, tokens)
    segments = [(name, ids.shape[-1]) for name, ids in parts.items()]
    return torch.cat(list(parts.values()), dim=-1), segments  # (1, Σ tokens)


def _text_input(text, ids, segments=None) -> dict | None:
    """The report's record of the text read: --text's file and digest, and the shipped kinds judged."""
    if not text and not segments:
        return None
    shipped = [name for name, _ in segments or [] if not name.startswith("--text")]
    given = {"path": str(text), "sha256": _sha256(Path(text))} if text else {}
    return given | {"tokens": int(ids.shape[-1]), "shipped_kinds": shipped or None}


def verify(src, converted_dir, opts) -> dict:
    """Verification as `gqa2mla` runs it, from its `ConvertOptions`."""
    return verify_with(src, converted_dir, opts.verify_options())
