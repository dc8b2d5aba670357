"""convert: GQA -> MLA checkpoint conversion, exact where the math allows it.

The API (each function's own help() says more; README.md, "Python API"):

    gqa2mla(src, output=None, **options) -> ConversionResult
        convert a checkpoint on disk into an MLA directory and verify it (`.passed`)
    to_mla(model, **options) -> the converted model, in memory (an nn.Module)
    convert_state_dict(state_dict, config, **options) -> MLAStateDict
    heal(model_or_path, texts, original=..., **options) -> HealResult (KL distillation)
    load_mla_model(path, device=None, dtype=None) -> MLAForCausalLM, a transformers causal LM
    factored_training(model): a context in which an absorbed model trains its query and output
        maps as their factors (about the source's step), multiplied back on exit

    options: the fields of ConvertOptions (help(convert.ConvertOptions)); heal's are those of
    convert.options.HealOptions. Bad input raises ConvertError (the CLI's exit 2), naming the
    parameter; the machine failing (disk full, permissions) EnvironmentFailure (exit 3).

    MLAForCausalLM, MLAConfig: the converted model's transformers classes (help(convert.MLAForCausalLM));
    `import convert` registers them (model type `convert_mla`) with transformers' Auto classes. They
    are left out of `__all__`, so help(convert) does not print transformers' pages of inherited text.

The command line imports the package light instead (LIGHT_IMPORT; docs/design.md, "Layout of the code").
"""

import os

from convert._version import __version__  # noqa: F401  (the public version)
from convert.errors import ConvertError, EnvironmentFailure
from convert.options import ConvertOptions

#: Set to "1" around `import convert` by the command line only (cli.py); see the docstring.
LIGHT_IMPORT = "CONVERT_LIGHT_IMPORT"

# The names that need torch and transformers, and where they live.
_HEAVY = {
    "ConversionResult": "convert.api",
    "MLAStateDict": "convert.api",
    "convert_state_dict": "convert.api",
    "gqa2mla": "convert.api",
    "to_mla": "convert.api",
    "factored_training": "convert.mla.lowrank",
    "MLAConfig": "convert.mla.causal_lm",
    "MLAForCausalLM": "convert.mla.causal_lm",
    "register": "convert.mla.causal_lm",
}


def _load() -> None:
    """Import the heavy names into the package and register `convert_mla` (once)."""
    import importlib

    if "register" in globals():
        return
    names = {name: getattr(importlib.import_module(module), name) for name, module in _HEAVY.items()}
    names["register"]()
    globals().update(names)


def __getattr__(name: str):
    """The heavy names on first use after a light import (PEP 562; never reached after a full one)."""
    if name in _HEAVY:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'convert' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HEAVY})


def heal(model_or_path, texts, **kwargs):
    """Distil a converted model toward the original's logits (see convert.healing.heal)."""
    _load()
    from convert.healing import heal as _heal

    return _heal(model_or_path, texts, **kwargs)


def load_mla_model(path, device=None, dtype=None):
    """Load a converted checkpoint as a runnable transformers causal LM (see convert.mla.model)."""
    _load()
    from convert.mla.model import load_mla_model as _load_model

    return _load_model(path, device=device, dtype=dtype)


if os.environ.get(LIGHT_IMPORT) != "1":
    _load()  # `convert_mla` checkpoints load with transformers' Auto classes once convert is imported


__all__ = [
    "ConversionResult",
    "ConvertError",
    "ConvertOptions",
    "EnvironmentFailure",
    "MLAStateDict",
    "convert_state_dict",
    "gqa2mla",
    "heal",
    "load_mla_model",
    "to_mla",
]
