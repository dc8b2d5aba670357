"""Healing: a distillation of a converted model toward the original's logits (docs/healing.md).

The MLA projections, and only they, are trained to minimise KL(original ‖ converted) of the next-token distributions,
on a live module in place or on a converted directory (an export included) written into a new directory.
"""

import json
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import ConvertError
from convert.healing.data import WindowsStreamed, read_tokens, token_stream, tokenizer_of
from convert.healing.objective import (
    Backtracking,
    distillation_loss,
    healing_optimizer,
    healing_scheduler,
    held_out_kl,
    trainable_parameters,
)
from convert.healing.report import healing_warnings, render_markdown
from convert.healing.state import claim, remove_checkpoints
from convert.healing.train import CHECK_TOKENS, hold_out, mixed_precision, train
from convert.hf import load_original
from convert.io import SAFETENSORS_DTYPES, CheckpointWriter, check_output, open_checkpoint, output_lock
from convert.mla.model import read_mla_config, weight_files
from convert.optim import relative_groups, relative_rates, warmup_cosine
from convert.options import HealOptions, as_path
from convert.progress import phase
from convert.sizes import parse_size
from convert.targets import load_output
from convert.verify import is_export
from convert.verify.report import original_named_by

__all__ = [
    "Backtracking",
    "HealResult",
    "distillation_loss",
    "heal",
    "healing_optimizer",
    "healing_scheduler",
    "heal_model",
    "healing_warnings",
    "held_out_kl",
    "relative_groups",
    "relative_rates",
    "render_markdown",
    "trainable_parameters",
    "warmup_cosine",
]

# Files of a converted directory that are not carried into a healed one: the weights
# (rewritten), convert's own bookkeeping, and the conversion's report (it describes the
# weights before healing; the healed directory's report is healing.json/.md).
_NOT_CARRIED = {
    "model.safetensors.index.json",
    ".convert-manifest.json",
    "verification.json",
    "verification.md",
    "verification.png",
    "healing.json",
    "healing.md",
}


@dataclass
class HealResult:
    """What `heal` did: the healed model and the figures of its report (`report`)."""

    model: torch.nn.Module
    report: dict
    output: Path | None = None


def heal_model(model, original, train_ids, eval_ids: torch.Tensor, opts: HealOptions, training_dir=None) -> dict:
    """Distil `model` toward `original` on `train_ids` (1, N) (or a `WindowsStreamed`) in place;
    the report's figures on `eval_ids` (1, N). See `convert.healing.train.train`."""
    report, accelerator = train(model, original, train_ids, eval_ids, opts, training_dir)
    accelerator.free_memory()  # drop accelerate's references to the model and optimizer
    return report


def _split(ids: torch.Tensor, eval_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out tokens: `eval_ids` when given, else the last eighth of `ids`."""
    if eval_ids is not None:
        return ids, eval_ids
    return hold_out(ids, 8, "evaluation tokens", "pass --eval-text")


def _ids(ids, n_tokens: int, what: str) -> torch.Tensor:
    """Token ids (1, ≤n_tokens) given to `heal` for a live module."""
    if not isinstance(ids, torch.Tensor):
        raise ConvertError(
            f"heal(model, {what}=...): a live model's tokenizer is not known here; pass token ids (1, N) from "
            "the model's tokenizer (text files are for a converted directory)"
        )
    return ids.reshape(1, -1)[:, :n_tokens]


def _paths(texts) -> list[Path]:
    """The files named by `texts` (one path or several)."""
    return [Path(texts)] if isinstance(texts, (str, Path)) else [Path(t) for t in texts]


def _files(texts) -> list[Path]:
    """The files among `heal`'s texts (none for token ids)."""
    return [] if texts is None or isinstance(texts, torch.Tensor) else _paths(texts)


def _directory_data(texts, eval_texts, converted: Path, vocab_size: int, opts: HealOptions):
    """What a converted directory heals on: training tokens (1, N) or a `WindowsStreamed`, and the
    held-out tokens (1, M), from files read with the directory's tokenizer (or token ids)."""
    assert opts.tokens is not None and opts.window is not None  # set by HealOptions.sized()
    if isinstance(texts, torch.Tensor):
        eval_ids = None if eval_texts is None else _ids(eval_texts, opts.tokens, "eval_texts")
        return _split(_ids(texts, opts.tokens, "texts"), eval_ids)
    tokenize = tokenizer_of(converted, vocab_size)
    eval_ids = None
    if eval_texts is not None:
        eval_ids = read_tokens(_paths(eval_texts), tokenize, opts.tokens, "--eval-text", opts.text_field)
    if opts.streaming:
        if eval_ids is None:
            raise ConvertError("--streaming reads --text as a stream, with no end to hold out: pass --eval-text")
        check_tokens = max(2, min(opts.tokens // 16, CHECK_TOKENS))
        held_out = -(-check_tokens // opts.window) if opts.check_every else 0  # whole windows
        paths = _paths(texts)
        stream = WindowsStreamed(
            lambda: token_stream(paths, tokenize, opts.text_field), opts.window, opts.seed, held_out
        )
        return stream, eval_ids
    return _split(read_tokens(_paths(texts), tokenize, opts.tokens, "--text", opts.text_field), eval_ids)


def _original_of(converted: Path, given) -> Path:
    """The original checkpoint: `--original`, else the one the conversion's report names."""
    if given is not None:
        return Path(given)
    named = original_named_by(converted)
    if named is not None:
        return named
    raise ConvertError(
        f"{converted}: no --original given and no verification.json naming an existing original checkpoint; "
        "pass --original PATH (the GQA checkpoint it was converted from)"
    )


def heal(model_or_path, texts, *, original=None, eval_texts=None, output=None, training_dir=None, **options):
    """Distil a converted model toward the original's logits (KL on `texts`); a `HealResult`
    whose `report` has the before/after perplexity and KL on held-out tokens.

    model_or_path: a converted MLA model (an nn.Module, e.g. from `convert.to_mla`; healed in
    place, `texts` and `eval_texts` token ids (1, N)) or a directory written by `convert gqa2mla`,
    an export included (healed as the runtime it was made for computes it, `convert.targets.
    load_output`, and written under its own tensor names to `output`, default `<dir>-healed`,
    atomically; `force=True` replaces only a directory convert wrote). For a directory `texts` are
    also text, JSONL or Parquet files (`convert.healing.data`), tokenized with its tokenizer.
    original: the original model or its checkpoint path (for a directory, default the one its
    verification.json names). eval_texts: held-out text (default: the last eighth of `texts`).
    training_dir: where checkpoints (`save_every`, `resume`) and tracker logs go (a directory's
    default: `<output>-training`). options: the fields of `HealOptions`. Under `accelerate launch`
    or `torchrun` every process calls it; the main one writes.
    """
    opts = HealOptions.from_kwargs(**options).sized()  # sizes left unset: the device's
    if isinstance(model_or_path, torch.nn.Module):
        if original is None:
            raise ConvertError("heal(model, ...): pass original= (the model it was converted from)")
        if output is not None:
            raise ConvertError("heal(model, ...) heals the module in place; output= is for a converted directory")
        if (opts.save_every or opts.resume) and training_dir is None:
            raise ConvertError("heal(model, ...): save_every / resume need training_dir= (where checkpoints go)")
        orig_model = original if isinstance(original, torch.nn.Module) else _load_original(original, model_or_path)
        ids = _ids(texts, opts.tokens, "texts")
        eval_ids = None if eval_texts is None else _ids(eval_texts, opts.tokens, "eval_texts")
        state_dir = None if training_dir is None else Path(training_dir)
        if state_dir is not None:
            claim(state_dir, opts.resume, opts.force, remove=_is_main_process())
        report = heal_model(model_or_path, orig_model, *_split(ids, eval_ids), opts, state_dir)
        return HealResult(model_or_path, report)
    where = as_path("model_or_path", model_or_path, "a converted model (an nn.Module) or its directory")
    return _heal_directory(where, texts, original, eval_texts, output, training_dir, opts)


def _is_main_process() -> bool:
    """Whether this is the process that writes (rank 0 of a launch, or the only one)."""
    return int(os.environ.get("RANK", "0")) == 0


def _load_original(path, like: torch.nn.Module):
    parameter = next(like.parameters())
    with open_checkpoint(Path(path)) as source:
        return load_original(source, source.config or {}, parameter.device, parameter.dtype)


def default_healed_output(converted: Path) -> Path:
    """`<dir>-healed` beside the converted directory."""
    return converted.resolve().parent / f"{converted.name}-healed"


def _heal_directory(converted: Path, texts, original, eval_texts, output, training_dir, opts: HealOptions):
    export = is_export(converted)
    config = json.loads((converted / "config.json").read_text()) if export else read_mla_config(converted)[0]
    original_path = _original_of(converted, original)
    output = Path(output) if output is not None else default_healed_output(converted)
    state_dir = Path(training_dir) if training_dir is not None else output.parent / f"{output.name}-training"
    inputs = [converted, original_path, *_files(texts), *_files(eval_texts)]
    main = _is_main_process()
    check_output(output, inputs, opts.force)  # every process: they refuse alike, before any collective
    claim(state_dir, opts.resume, opts.force, remove=main)
    with output_lock(output, inputs, opts.force) if main else nullcontext():
        with phase("loading both models", opts.progress and main):
            model = load_output(converted, opts.torch_device, torch.float32)  # an export as its runtime runs it
            orig_model = _load_original(original_path, model)
            if mixed_precision(opts) == "bf16":  # frozen, its matmuls in bf16 under autocast anyway: half the memory
                orig_model.to(torch.bfloat16)
        with phase("reading the text", opts.progress and main):
            train_data, eval_ids = _directory_data(texts, eval_texts, converted, config["vocab_size"], opts)
        report, accelerator = train(model, orig_model, train_data, eval_ids, opts, state_dir)
        report["inputs"] = {"converted": str(converted), "original": str(original_path)}
        report["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
        state = accelerator.get_state_dict(model)  # gathered onto the main process under FSDP
        with phase("writing the healed checkpoint", opts.progress and main):
            final = _write_healed(converted, output, state, report, export, config, opts) if main else output
        accelerator.wait_for_everyone()
        if main:
            remove_checkpoints(state_dir, finished=True)  # the run is complete: its checkpoints are not needed
        accelerator.free_memory()  # drop accelerate's references to the model and optimizer
    return HealResult(model, report, final)


def _write_healed(converted: Path, output: Path, state: dict, report: dict, export: bool, config: dict, opts):
    """Write the healed weights under the converted directory's names and dtypes, its other files,
    and the report, atomically."""
    layout, dtypes = {}, {}
    for file in weight_files(converted):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sliced = f.get_slice(name)
                dtypes[name] = SAFETENSORS_DTYPES[sliced.get_dtype()]
                layout[name] = (tuple(sliced.get_shape()), dtypes[name])
    metadata = {"format": "pt"}
    if not export:
        metadata["mla_format_version"] = str(config["mla"]["format_version"])
    with CheckpointWriter(output, layout, parse_size(opts.max_shard_size), opts.force, metadata) as writer:
        for name in layout:
            writer.write(name, state[name].detach().to("cpu", dtypes[name]).contiguous())
        for item in sorted(converted.iterdir()):
            if item.is_file() and item.suffix != ".safetensors" and item.name not in _NOT_CARRIED:
                writer.copy_file(item.name, item)
        writer.write_json("healing.json", report)
        writer.write_text("healing.md", render_markdown(report))
        return writer.commit()
