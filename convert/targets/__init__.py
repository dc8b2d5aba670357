"""Deployment targets: what `--target` writes. `TARGETS` is the one table (name, options, module) and
the only place that says which target wrote an output (`written_by`); each module implements `Target`
(an export's also `ExportTarget`). docs/design.md, "Deployment targets"."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from convert.errors import ConvertError
from convert.options.fields import cli_fields, field_default, long_flag

if TYPE_CHECKING:  # the interfaces' types; importing them needs torch, which the light CLI path does not load
    import torch

    from convert.arch import AttentionSpec
    from convert.io.tensor_source import TensorSource
    from convert.options import ConvertOptions
    from convert.plan import ConversionPlan
    from convert.transform import LayerInfo


@dataclass(frozen=True)
class TargetEntry:
    """A target as the options see it (no torch needed): its name, the module that implements it,
    and which option groups it takes."""

    name: str
    module: str
    compresses: bool  # takes the options declared needs="compresses" (--layout, --rank, --method...)
    calibrates: bool  # takes those declared needs="calibrates" (--calib, --max-ppl-ratio...)
    export: bool  # writes another runtime's format, recorded in config.json's `convert_export`
    sized: bool = False  # takes --kv-cache-ratio (needs="sized": the latent's width) without the others

    def takes(self, need: str) -> bool:
        """Whether the target takes an option that needs `need` (its `Flag.needs`)."""
        if need == "sized":
            return self.compresses or self.sized
        return {"compresses": self.compresses, "calibrates": self.calibrates}[need]

    def implementation(self):
        """The module implementing the target's interface (imported on first use: it needs torch)."""
        return importlib.import_module(self.module)


TARGETS = {
    "mla": TargetEntry("mla", "convert.targets.mla", compresses=True, calibrates=True, export=False),
    "transformers": TargetEntry(
        "transformers", "convert.targets.transformers", compresses=False, calibrates=False, export=True
    ),
    "vllm": TargetEntry("vllm", "convert.targets.vllm", compresses=False, calibrates=True, export=True),
    "llamacpp": TargetEntry(
        "llamacpp", "convert.targets.llamacpp", compresses=False, calibrates=True, export=True, sized=True
    ),
}

#: The exports' latent width (vLLM's kv_lora_rank, `targets.vllm.geometry.KV_LORA_RANK`, which needs torch)
EXPORT_LATENT = 512


def check_options(opts) -> None:
    """Refuse the flags `opts.target` would ignore (it writes one fixed layout, or takes no
    calibration text): those given away from their default whose declaration (`Flag.needs`) asks for
    what the target does not do. No torch needed, so the command line refuses them at once."""
    entry = TARGETS[opts.target]
    given = [
        long_flag(f)
        for f in cli_fields(type(opts))
        if f.metadata.get("needs") and not entry.takes(f.metadata["needs"]) and _given(opts, f)
    ]
    if opts.gguf_type is not None and opts.target != "llamacpp":
        raise ConvertError(f"--gguf-type: only for --target llamacpp (--target {opts.target} writes no GGUF); drop it")
    if opts.latent_multiple is not None and opts.target != "llamacpp":
        raise ConvertError(
            f"--latent-multiple: only for --target llamacpp (it rounds the GGUF's kv_lora_rank; --target {opts.target} "
            "writes none); drop it"
        )
    if opts.latent_multiple is not None and EXPORT_LATENT % opts.latent_multiple:
        raise ConvertError(
            f"--latent-multiple {opts.latent_multiple}: the latent is at most {EXPORT_LATENT} dims wide, so give a "
            f"divisor of {EXPORT_LATENT} (64 or 128: llama.cpp's CPU attention's blocks)"
        )
    if given:
        raise ConvertError(
            f"{', '.join(given)}: only for --target mla (--target {opts.target} writes one fixed layout); "
            "drop them or use --target mla"
        )


def _given(opts, f) -> bool:
    """Whether option field `f` was given a value of its own (not its default, not None, not False)."""
    value = getattr(opts, f.name)
    return value is not None and value is not False and value != field_default(f)


@dataclass
class Build:
    """What a target hands the writer: the layout of every tensor it writes, the source tensors it
    copies byte for byte, the rest as a stream of (name, tensor) in the layout's order, and what
    can be said once the stream is consumed (config, notes, sizes)."""

    layout: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every tensor written: name -> (shape, dtype)
    copied: list[str]  # of those, the source's tensors copied byte for byte
    tensors: Iterator[tuple[str, torch.Tensor]]  # the rest, in the layout's order
    config: Callable[[], dict]  # config.json, once `tensors` is consumed
    notes: Callable[[], list[str]]
    sizes: Callable[[], dict]
    metadata: dict[str, str]  # the safetensors header's
    options: ConvertOptions  # the options as the target resolved them (what verification then uses)
    layers: list[LayerInfo] = field(default_factory=list)  # the mla target's, per layer
    plan: ConversionPlan | None = None
    # writes the target's own files into the not yet committed output directory, after the tensors
    # (the llamacpp target's one GGUF file); None: the tensors are the whole output
    extra: Callable[[Path], None] | None = None


@runtime_checkable
class Target(Protocol):
    """What a target's module provides (`TARGETS[name].implementation()`)."""

    NAME: str
    FOREIGN: str  # what other runtimes make of its output

    def check(self, spec: AttentionSpec, opts: ConvertOptions) -> None:
        """Refuse (ConvertError) what the target cannot express for this attention spec."""

    def build(self, source: TensorSource, opts: ConvertOptions) -> Build:
        """Stream the output's tensors and config from a checkpoint (its `config` beside its tensors),
        every refusal first."""

    def model(
        self,
        state: dict[str, torch.Tensor],
        config: dict,
        opts: ConvertOptions,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        """The output built in memory, as its runtime computes it (`to_mla`)."""

    def load(self, path: str | Path, device: str | torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
        """Open a written output in the runtime it was made for."""


@runtime_checkable
class ExportTarget(Target, Protocol):
    """A target that writes another runtime's format (`TargetEntry.export`)."""

    def report(self, export: dict, e2e: dict | None, ckpt_dtype: torch.dtype) -> dict | None:
        """The verification report's section on the export (`export`: config.json's `convert_export`)."""


def target(name: str) -> Target:
    """The module implementing target `name` (`TARGETS`)."""
    return TARGETS[name].implementation()


def written_by(config: dict) -> str | None:
    """The name of the target that wrote a directory with this config.json (an export records its
    name in `convert_export`; the native format has an `mla` section), None for a checkpoint that no
    target wrote."""
    export = config.get("convert_export")
    if isinstance(export, dict):
        return export.get("target", "transformers")  # exports written before the field: transformers
    return "mla" if "mla" in config else None


def output_target(config: dict) -> Target:
    """The target that wrote a directory with this config.json; the native format's when none did
    (its checks say what is wrong with the directory)."""
    return target(written_by(config) or "mla")


def load_output(path: str | Path, device: str | torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
    """Any output of this package, opened in the runtime its target was made for."""
    config = json.loads((Path(path) / "config.json").read_text())
    return output_target(config).load(path, device, dtype)
