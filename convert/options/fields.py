"""How an option is declared once (its flag, help, choices and `--help` section), the choices
themselves, and the checks every option class shares. No torch at import (tests/cli/test_cli_startup.py)."""

from __future__ import annotations

import numbers
import os
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from convert.arch.registry import ARCHS
from convert.errors import ConvertError, UnknownOption

if TYPE_CHECKING:
    import torch


#: The `--target` choices: the names of `convert.targets.TARGETS`, which checks the flags each takes.
TARGETS = ("mla", "transformers", "vllm", "llamacpp")
#: --gguf-type: the llamacpp target's tensor types (the quantized ones by llama.cpp's own quantizer)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")
LAYOUTS = ("absorbed", "factored")
LATENTS = ("split", "joint")
DEVICES = ("auto", "cpu", "cuda")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
TRACKERS = ("auto", "none", "tensorboard", "wandb", "mlflow")
E2E_MODES = ("auto", "whole", "streamed")
METHODS = ("svd", "whitened", "fisher")
ALLOCATIONS = ("uniform", "global")
CALIBRATIONS = ("original", "sequential")
ARCH_NAMES = tuple(ARCHS)  # --arch: the registry's families, in one place (help, choices and find_arch's error)
DTYPES = ("float64", "float32", "bfloat16", "float16")
RUN_DTYPES = ("auto", *DTYPES)  # verification: auto follows the checkpoint (`VerifyOptions.run_dtype`)

#: The sections of `--help`, in the order people reach for them; `option(group=...)` names one.
GROUPS = {
    "output": "Input and output",
    "layout": "Layout (exact)",
    "compression": "Compression (lossy; the default is the exact conversion)",
    "verification": "Verification",
    "training": "Training",
    "target": "Target",
    "advanced": "Advanced",
}


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """{"float32": torch.float32, ...}: the dtypes options name, imported on first use."""
    import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

    return {name: getattr(torch, name) for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the name options, configs and reports use)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Flag:
    """How one option shows on the command line, besides its help and section.

    flag: the long flag (default `--field-name`); off_flag: for a boolean whose CLI flag switches
    it off (`verify` <- `--no-verify`); kind: the click value type when it differs from the
    default's (Path, int, float, str); multiple: the flag may be repeated (the values as a tuple); cli:
    False for an option of the Python API alone; needs: what a target must do to take the option
    ("compresses", "calibrates", "sized": a `convert.targets.TargetEntry` capability), the others
    refusing it when it is given (`convert.targets.check_options`).
    """

    choices: tuple | None = None
    flag: str | None = None
    short: str | None = None
    off_flag: str | None = None
    kind: type | None = None
    multiple: bool = False
    cli: bool = True
    needs: str | None = None


def option(default, help: str, *, group: str, **flag):
    """A dataclass field with its CLI description as metadata: `help`, `group` (its section of
    `--help`, a key of GROUPS) and the fields of `Flag` (`flag`: their values)."""
    if group not in GROUPS:
        raise ValueError(f"group {group!r} is not one of {', '.join(GROUPS)}")
    return field(default=default, metadata={"help": help, "group": group, **vars(Flag(**flag))})


def suggest(word: str, known) -> list[str]:
    """The known names `word` is likely a typo of, best first: those it begins or that begin with
    it, else the closest by spelling, only those near the best (no list of unrelated options)."""
    import difflib

    known = sorted(known)
    stem = word.lstrip("-")
    prefixed = [
        k for k in known if len(stem) >= 2 and (k.lstrip("-").startswith(stem) or stem.startswith(k.lstrip("-")))
    ]
    if prefixed:
        return prefixed[:3]
    scored = sorted(((difflib.SequenceMatcher(None, word, k).ratio(), k) for k in known), reverse=True)
    best = scored[0][0] if scored else 0.0
    return [k for score, k in scored if score >= 0.6 and score >= best - 0.05][:3]


class FromKwargs:
    @classmethod
    def from_kwargs(cls, **kwargs):
        """Build from keyword options, refusing an unknown name with the likely one it misspells."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            name = unknown[0]
            likely = suggest(name, known)
            fix = f"did you mean {' or '.join(likely)}?" if likely else f"the options are {', '.join(sorted(known))}"
            raise UnknownOption(f"unknown option {name}={kwargs[name]!r}; {fix}")
        for f in fields(cls):
            if f.name in kwargs:
                _check_type(f.name, kwargs[f.name], f.type)
        return cls(**kwargs)


def as_path(name: str, value, expected: str = "a path (str or os.PathLike)") -> Path:
    """A path argument of the Python API as a Path, or a ConvertError naming the parameter."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConvertError(f"{name}={value!r:.60}: expected {expected}, got {type(value).__name__}")
    return Path(value)


#: An annotation's names -> what a value of it may be, and how a message names it.
_TYPES = {
    "int": ((numbers.Integral,), "an int"),
    "float": ((numbers.Real,), "a number"),
    "str": ((str,), "a str"),
    "bool": ((bool,), "True or False"),
    "Path": ((str, os.PathLike), "a path"),
    "list": ((list, tuple), "a list of paths"),
    "None": ((type(None),), "None"),
}


def _check_type(name: str, value, annotation: str) -> None:
    """Refuse a keyword option whose value is not of its field's annotation ("int | None", ...)
    as a ConvertError naming it, before it fails deep inside as a TypeError."""
    kinds = [kind.strip() for kind in annotation.split("|")]
    if "torch.Tensor" in kinds and type(value).__module__.split(".")[0] == "torch":
        return
    accepted = [_TYPES[kind] for kind in kinds if kind in _TYPES]
    ok = any(isinstance(value, types) for types, _ in accepted)
    if isinstance(value, (list, tuple)) and "list" in kinds:  # a list of paths: each one a path
        ok = all(isinstance(item, (str, os.PathLike)) for item in value)
    if isinstance(value, bool) and "bool" not in kinds:
        ok = False  # True is an int to Python, not a count or a ratio
    if not ok:
        names = [text for _, text in accepted] + (["a torch.Tensor"] if "torch.Tensor" in kinds else [])
        raise ConvertError(f"{name}={value!r}: expected {' or '.join(names)}, got {type(value).__name__}")


def cli_fields(cls) -> list:
    """The dataclass fields of `cls` that are CLI flags, in `--help` order: by section (GROUPS);
    within one, its own fields before its base's (gqa2mla's before verify's), as declared."""
    rank = {group: i for i, group in enumerate(GROUPS)}
    inherited = {f.name for base in cls.__mro__[1:] if hasattr(base, "__dataclass_fields__") for f in fields(base)}
    cli = [f for f in fields(cls) if f.metadata.get("cli", False)]
    return sorted(cli, key=lambda f: (rank[f.metadata["group"]], f.name in inherited))  # stable sort


def long_flag(f) -> str:
    """An options field's long flag: its declared `flag`, else `--field-name`."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def field_default(f):
    return None if f.default is MISSING else f.default


def resolve_device(name: str) -> torch.device:
    """auto = CUDA when present, else CPU; an explicit cuda without one is refused."""
    import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConvertError("--device cuda: no CUDA device is visible to torch; use --device auto or cpu")
    return torch.device(name)


def choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConvertError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
