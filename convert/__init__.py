"""convert: GQA -> MLA checkpoint conversion, exact where the math allows it.

Python API:
    gqa2mla(src, output=None, **options) -> ConversionResult
    convert_state_dict(state_dict, config, **options) -> MLAStateDict
    to_mla(model, **options) -> the converted model, in memory (an nn.Module)
    heal(model_or_path, texts, original=..., **options) -> HealResult (KL distillation)
    load_mla_model(path, device=None, dtype=None) -> a transformers causal LM
"""

from convert._version import __version__  # noqa: F401  (the public version)
from convert.api import ConversionResult, MLAStateDict, convert_state_dict, gqa2mla, to_mla
from convert.errors import ConvertError, EnvironmentFailure
from convert.hf import MLAConfig, MLAForCausalLM, register
from convert.options import ConvertOptions

register()  # `convert_mla` checkpoints load with transformers' Auto classes once convert is imported


def heal(model_or_path, texts, **kwargs):
    """Distil a converted model toward the original's logits (see convert.healing.heal)."""
    from convert.healing import heal as _heal

    return _heal(model_or_path, texts, **kwargs)


def load_mla_model(path, device=None, dtype=None):
    """Load a converted checkpoint as a runnable transformers causal LM (see convert.mla.model)."""
    from convert.mla.model import load_mla_model as _load

    return _load(path, device=device, dtype=dtype)


__all__ = [
    "ConversionResult",
    "ConvertError",
    "ConvertOptions",
    "EnvironmentFailure",
    "MLAConfig",
    "MLAForCausalLM",
    "MLAStateDict",
    "convert_state_dict",
    "gqa2mla",
    "heal",
    "load_mla_model",
    "to_mla",
]
