"""Type and range checks of config.json's fields, before any of its values is used.

A wrong type (a head count written as a string, a 40-digit layer count) would otherwise surface as an exception deep
in planning or transformers; here it is a one-line refusal. Consistency with the tensors is `convert.arch.spec`'s.
"""

import math
from collections.abc import Callable
from typing import Any

from convert.arch import geometry
from convert.errors import ConvertError
from convert.rope import config as rope_config

#: The largest integer a dimension or count may be: real models are far below it.
MAX_INT = 2**31 - 1

#: transformers' RoPE variants (ROPE_INIT_FUNCTIONS plus "default").
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
#: Fields each RoPE variant cannot do without.
ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")

# A checker returns None when the value is fine, else what is wrong and what to write instead.
Problem = tuple[str, str] | None


def _kind(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", str: "a string", float: "a float", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _int_problem(value: Any, minimum: int) -> Problem:
    want = f"an integer >= {minimum} and below 2**31"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"is {_kind(value)}, not an integer", want
    if value < minimum:
        return f"is below {minimum}", want
    if value > MAX_INT:
        return "is out of range", want
    return None


def count(value: Any) -> Problem:
    """A positive integer below 2**31 (a dimension, a head or layer count)."""
    return _int_problem(value, 1)


def index(value: Any) -> Problem:
    """A non-negative integer below 2**31 (a token id, a layer index)."""
    return _int_problem(value, 0)


def _number_problem(value: Any, positive: bool) -> Problem:
    want = "a positive number" if positive else "a number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {_kind(value)}, not a number", want
    if not math.isfinite(value):
        return "is not finite", want
    if value < 0 or (positive and value == 0):
        return "is out of range", want
    return None


def positive(value: Any) -> Problem:
    """A finite number > 0."""
    return _number_problem(value, positive=True)


def non_negative(value: Any) -> Problem:
    """A finite number >= 0."""
    return _number_problem(value, positive=False)


def fraction(value: Any) -> Problem:
    """A number in (0, 1]."""
    problem = positive(value)
    if problem is None and value > 1:
        return "is above 1", "a number in (0, 1]"
    return problem


def probability(value: Any) -> Problem:
    """A number in [0, 1]."""
    problem = non_negative(value)
    if problem is None and value > 1:
        return "is above 1", "a number in [0, 1]"
    return problem


def flag(value: Any) -> Problem:
    return None if isinstance(value, bool) else (f"is {_kind(value)}, not a boolean", "true or false")


def string(value: Any) -> Problem:
    return None if isinstance(value, str) and value else (f"is {_kind(value)}, not a name", "a non-empty string")


def token_ids(value: Any) -> Problem:
    """One token id or a list of them (eos_token_id may be a list)."""
    items = value if isinstance(value, list) else [value]
    problems = [index(v) for v in items]
    if not items or any(problems):
        return "is not a token id", "a non-negative integer or a list of them"
    return None


def positive_list(value: Any) -> Problem:
    if not isinstance(value, list) or not value or any(positive(v) for v in value):
        return f"is {_kind(value)}, not a list of positive numbers", "a list of positive numbers"
    return None


# field: (checker, whether null is allowed: it means "the default" for these)
TOP_LEVEL: dict[str, tuple[Callable[[Any], Problem], bool]] = {
    "model_type": (string, False),
    "hidden_size": (count, False),
    "num_attention_heads": (count, False),
    "num_hidden_layers": (count, False),
    "vocab_size": (count, False),
    "intermediate_size": (count, False),
    "max_position_embeddings": (count, False),
    "num_key_value_heads": (count, True),
    "head_dim": (count, True),
    "sliding_window": (count, True),
    "max_window_layers": (index, True),
    "pretraining_tp": (count, True),
    "bos_token_id": (token_ids, True),
    "eos_token_id": (token_ids, True),
    "pad_token_id": (token_ids, True),
    "rms_norm_eps": (positive, False),
    "rope_theta": (positive, True),
    "partial_rotary_factor": (fraction, True),
    "initializer_range": (non_negative, True),
    "attention_dropout": (probability, True),
    "tie_word_embeddings": (flag, False),
    "attention_bias": (flag, False),
    "mlp_bias": (flag, False),
    "use_sliding_window": (flag, True),
    "use_cache": (flag, True),
    "hidden_act": (string, False),
    "dtype": (string, True),
    "torch_dtype": (string, True),
}

ROPE_FIELDS: dict[str, Callable[[Any], Problem]] = {
    "rope_theta": positive,
    "factor": positive,
    "original_max_position_embeddings": count,
    "attention_factor": positive,
    "beta_fast": positive,
    "beta_slow": positive,
    "mscale": non_negative,
    "mscale_all_dim": non_negative,
    "low_freq_factor": positive,
    "high_freq_factor": positive,
    "partial_rotary_factor": fraction,
    "short_factor": positive_list,
    "long_factor": positive_list,
    "truncate": flag,
}


def _show(value: Any, limit: int = 40) -> str:
    """repr of a config value, cut short (a damaged one may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


FIX = "fix or re-download the file"


def refuse(where: str, field: str, value: Any, problem: tuple[str, str], fix: str = FIX) -> ConvertError:
    """The one-line error for a bad field: file, field, value, what is wrong, what to write."""
    what, want = problem
    return ConvertError(f"{where} {field}={_show(value)} {what}; write {want} there ({fix})")


def check_field(where: str, field: str, value: Any, checker: Callable[[Any], Problem], fix: str = FIX) -> None:
    """Refuse `value` of `field` when `checker` finds a problem."""
    problem = checker(value)
    if problem is not None:
        raise refuse(where, field, value, problem, fix)


def one_of(choices: tuple[str, ...]) -> Callable[[Any], Problem]:
    """A checker accepting exactly these strings."""
    return lambda value: (
        None if isinstance(value, str) and value in choices else ("is not known", f"one of {', '.join(choices)}")
    )


def check_config(config: dict, where: str = "config.json") -> None:
    """Refuse a config.json whose fields have the wrong type or range.

    where: how messages name the file. Absent fields are fine (the family's
    default applies); null is accepted only where it means the default. Only the fields of
    `TOP_LEVEL`, `ROPE_FIELDS` and `layer_types` are checked; others pass through untouched.
    """
    for field, (checker, nullable) in TOP_LEVEL.items():
        if field in config and not (nullable and config[field] is None):
            check_field(where, field, config[field], checker)
    for field in rope_config.FIELDS:
        if config.get(field) is not None:
            check_rope(config[field], field, config, where)
    _check_layer_types(config, where)


def check_rope(params: Any, field: str, config: dict, where: str) -> None:
    """`rope_parameters` / `rope_scaling`: an object with a known type and well-typed fields
    (or, transformers 5, one such object per layer type)."""
    if not isinstance(params, dict):
        raise refuse(
            where, field, params, (f"is {_kind(params)}, not an object", 'an object such as {"rope_type": "default"}')
        )
    if params and all(isinstance(v, dict) for v in params.values()) and set(params) <= set(LAYER_TYPES):
        for layer_type, per_type in params.items():
            check_rope(per_type, f"{field}.{layer_type}", config, where)
        return
    rope_type = _checked_rope_type(params, field, where)
    for key, checker in ROPE_FIELDS.items():
        if key in params:
            check_field(where, f"{field}.{key}", params[key], checker)
    for key in ROPE_REQUIRED.get(rope_type, ()):
        if key not in params:
            raise ConvertError(
                f"{where} {field} of rope_type {rope_type!r} has no {key!r}; add it (see the model's original config)"
            )
    _check_rope_consistency(params, field, config, where)


def _checked_rope_type(params: dict, field: str, where: str) -> str:
    """The RoPE variant, from `rope_type` (or the older `type`); the two must agree."""
    for key in ("rope_type", "type"):
        if key in params and params[key] not in ROPE_TYPES:
            raise refuse(
                where, f"{field}.{key}", params[key], ("is not a known RoPE type", f"one of {', '.join(ROPE_TYPES)}")
            )
    if "rope_type" in params and "type" in params and params["rope_type"] != params["type"]:
        raise ConvertError(
            f"{where} {field} has rope_type={params['rope_type']!r} but type={params['type']!r}; keep one of them"
        )
    return params.get("rope_type", params.get("type", "default"))


def _check_rope_consistency(params: dict, field: str, config: dict, where: str) -> None:
    """Relations between RoPE fields that would otherwise divide by zero or index out of range."""
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if low is not None and high is not None and high <= low:
        raise ConvertError(
            f"{where} {field}.high_freq_factor={high} is not above low_freq_factor={low}; "
            "high_freq_factor must be the larger (Llama 3 uses 4.0 and 1.0)"
        )
    head_dim = geometry.head_dim_if_known(config)
    for key in ("short_factor", "long_factor"):
        if key in params and head_dim is not None and len(params[key]) != head_dim // 2:
            raise ConvertError(
                f"{where} {field}.{key} has {len(params[key])} entries, head_dim {head_dim} needs "
                f"{head_dim // 2}; fix the list"
            )


def _check_layer_types(config: dict, where: str) -> None:
    """`layer_types`: one known attention kind per layer."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or any(t not in LAYER_TYPES for t in layer_types):
        raise refuse(
            where, "layer_types", layer_types, ("is not a list of layer kinds", f"a list of {' / '.join(LAYER_TYPES)}")
        )
    n_layers = config.get("num_hidden_layers")
    if n_layers is not None and len(layer_types) != n_layers:
        raise ConvertError(
            f"{where} layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}; "
            "give one entry per layer"
        )
