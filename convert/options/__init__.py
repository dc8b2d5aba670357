"""The options of every command, declared once: flag, help, choices and `--help` section
(`fields`), for conversion and verification (`conversion`), healing and evaluation (`training`).
`convert.cli` builds its click options from them, so the CLI and the Python API cannot drift apart
(tests/cli/test_cli_parity.py). No torch at import (tests/cli/test_cli_startup.py)."""

from convert.options.conversion import ConvertOptions, VerifyOptions
from convert.options.fields import (
    ALLOCATIONS,
    ARCH_NAMES,
    CALIBRATIONS,
    DEVICES,
    DTYPES,
    E2E_MODES,
    GROUPS,
    LATENTS,
    LAYOUTS,
    METHODS,
    MIXED_PRECISIONS,
    RUN_DTYPES,
    TARGETS,
    TRACKERS,
    Flag,
    as_path,
    cli_fields,
    dtype_name,
    field_default,
    long_flag,
    option,
    resolve_device,
    suggest,
    torch_dtypes,
)
from convert.options.terms import python_terms
from convert.options.training import EVAL_TASKS, HEAL_SIZES, EvalOptions, HealOptions, heal_sizes

__all__ = [
    "ALLOCATIONS",
    "ARCH_NAMES",
    "CALIBRATIONS",
    "DEVICES",
    "DTYPES",
    "E2E_MODES",
    "EVAL_TASKS",
    "GROUPS",
    "HEAL_SIZES",
    "LATENTS",
    "LAYOUTS",
    "METHODS",
    "MIXED_PRECISIONS",
    "RUN_DTYPES",
    "TARGETS",
    "TRACKERS",
    "ConvertOptions",
    "EvalOptions",
    "Flag",
    "HealOptions",
    "VerifyOptions",
    "as_path",
    "cli_fields",
    "dtype_name",
    "field_default",
    "heal_sizes",
    "long_flag",
    "option",
    "python_terms",
    "resolve_device",
    "suggest",
    "torch_dtypes",
]


def __getattr__(name: str):
    """`TORCH_DTYPES` ({"float32": torch.float32, ...}), built on first use (PEP 562)."""
    if name == "TORCH_DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
