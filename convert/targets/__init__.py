"""Deployment targets: what `--target` writes, each behind one interface (docs/design.md,
"Deployment targets"). `TARGETS` is the one table: a target's name, the options it takes and the
module that implements it: `check(spec, opts)` refuses what it cannot express, `build(source,
opts)` streams its tensors and config (`Build`), `model(...)` builds it in memory (`to_mla`),
`load(path, device, dtype)` opens its output in the runtime it was made for, `report(...)` adds its
section to the verification report, and `FOREIGN` says what other runtimes make of its output.
`convert.api` picks a target here; verification and healing open outputs with `load_output`."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from convert.errors import ConvertError


@dataclass(frozen=True)
class TargetEntry:
    """A target as the options see it (no torch needed): its name, the module that implements it,
    and which option groups it takes."""

    name: str
    module: str
    compresses: bool  # takes --layout, --latent, --rank, --kv-cache-ratio, --method, --allocation
    calibrates: bool  # takes --calib, --max-ppl-ratio, --calibration

    def implementation(self):
        """The module implementing the target's interface (imported on first use: it needs torch)."""
        return importlib.import_module(self.module)


TARGETS = {
    "mla": TargetEntry("mla", "convert.targets.mla", compresses=True, calibrates=True),
    "transformers": TargetEntry("transformers", "convert.targets.transformers", compresses=False, calibrates=False),
    "vllm": TargetEntry("vllm", "convert.targets.vllm", compresses=False, calibrates=True),
}


def check_options(opts) -> None:
    """Refuse the flags `opts.target` would ignore (it writes one fixed layout, or takes no
    calibration text); no torch needed, so the command line refuses them at once."""
    entry = TARGETS[opts.target]
    shape = {
        "--layout": opts.layout != "absorbed",
        "--latent": opts.latent != "split",
        "--rank": opts.rank,
        "--kv-cache-ratio": opts.kv_cache_ratio,
        "--method": opts.method,
        "--allocation": opts.allocation,
    }
    calibration = {"--calib": opts.calib, "--max-ppl-ratio": opts.max_ppl_ratio, "--calibration": opts.calibration}
    ignored = ({} if entry.compresses else shape) | ({} if entry.calibrates else calibration)
    order = ("--layout", "--latent", "--rank", "--kv-cache-ratio", "--method", "--calib", "--allocation")
    given = [flag for flag in (*order, "--max-ppl-ratio", "--calibration") if ignored.get(flag) not in (None, False)]
    if given:
        raise ConvertError(
            f"{', '.join(given)}: only for --target mla (--target {opts.target} writes one fixed layout); "
            "drop them or use --target mla"
        )


@dataclass
class Build:
    """What a target hands the writer: the layout of every tensor it writes, the source tensors it
    copies byte for byte, the rest as a stream of (name, tensor) in the layout's order, and what
    can be said once the stream is consumed (config, notes, sizes)."""

    layout: dict
    copied: list[str]
    tensors: Iterator
    config: Callable[[], dict]
    notes: Callable[[], list[str]]
    sizes: Callable[[], dict]
    metadata: dict
    options: object  # the options as the target resolved them (what verification then uses)
    layers: list = field(default_factory=list)
    plan: object = None


def target(name: str):
    """The module implementing target `name` (`TARGETS`)."""
    return TARGETS[name].implementation()


def output_target(config: dict):
    """The target that wrote a directory with this config.json: an export records its name."""
    export = config.get("convert_export")
    return target(export.get("target", "transformers") if isinstance(export, dict) else "mla")


def load_output(path, device, dtype):
    """Any output of this package, opened in the runtime its target was made for."""
    config = json.loads((Path(path) / "config.json").read_text())
    return output_target(config).load(path, device, dtype)
