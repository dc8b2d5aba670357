"""Fuzzing config.json: a config of the wrong type, range or shape for the tensors ends in one
clean `error:` line and exit 2 with nothing on disk, an equivalent one converts, a valid other
model may do either (tests/fuzzing.py)."""

import json
import random
import shutil

import fuzzing
import pytest
from fuzzing import CONFIG, SEED, Case, Tally, run_conversion

from conftest import TINY_LLAMA

N_CONFIG = 300  # at least this many cases

one_thread = fuzzing.one_thread  # autouse: the cases run on one torch thread


def _config_text(changes: dict, drop: tuple = ()) -> str:
    config = {k: v for k, v in CONFIG.items() if k not in drop}
    return json.dumps({**config, **changes})


def _replace_value(field: str, raw: str) -> str:
    """config.json with `field`'s value written as raw JSON text (huge numbers, NaN, …)."""
    return _config_text({field: "@@"}).replace('"@@"', raw)


INT_FIELDS = {
    "num_attention_heads": [1, 2, 8, 3],
    "num_key_value_heads": [1, 4, 3],
    "num_hidden_layers": [1, 3, 4],
    "hidden_size": [32, 48, 128],
    "head_dim": [8, 32],
    "vocab_size": [127, 129, 256],
    "intermediate_size": [95, 97, 192],
    "max_position_embeddings": [],
}


def _c_int_type(rng):
    field = rng.choice(list(INT_FIELDS))
    value = CONFIG[field]
    bad = rng.choice([str(value), value + 0.5, float(value), True, [value], {"v": value}, 0, -value, False])
    return Case("int-type", "refuse", f"{field}={bad!r}", _config_text({field: bad}))


def _c_int_range(rng):
    field = rng.choice(list(INT_FIELDS))
    raw = rng.choice([str(2**31), str(2**63), str(10**30), "1" + "0" * 5000, "NaN", "Infinity", "-Infinity", "1e3"])
    return Case("int-range", "refuse", f"{field}={raw[:12]}", _replace_value(field, raw))


def _c_int_value(rng):
    field = rng.choice([f for f, values in INT_FIELDS.items() if values])
    value = rng.choice(INT_FIELDS[field])
    return Case("int-inconsistent", "refuse", f"{field}={value}", _config_text({field: value}))


def _c_null_or_absent(rng):
    field = rng.choice(list(INT_FIELDS) + ["rms_norm_eps", "tie_word_embeddings", "hidden_act", "model_type"])
    absent = rng.random() < 0.5
    # null/absent means transformers' default: equivalent for head_dim (64 / 4 = 16), a
    # different model for max_position_embeddings and the activation; refused where the
    # default differs from this checkpoint or null means nothing.
    if field == "head_dim":
        expect = "pass"
    elif absent and field in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act"):
        expect = "either"
    elif absent and field == "model_type":
        expect = "refuse"  # a bare file: --arch needed
    else:
        expect = "refuse"
    text = _config_text({}, drop=(field,)) if absent else _config_text({field: None})
    return Case("null-or-absent", expect, f"{field} {'absent' if absent else 'null'}", text)


def _c_numbers(rng):
    field = rng.choice(["rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout"])
    bad = rng.choice(["1e-6", -1e-6, 0 if field != "initializer_range" else -1, [1e-6], True, {"x": 1}])
    if field == "attention_dropout" and bad == 0:
        bad = 2.0
    return Case("numbers", "refuse", f"{field}={bad!r}", _config_text({field: bad}))


def _c_number_constants(rng):
    field = rng.choice(["rms_norm_eps", "rope_theta", "initializer_range"])
    raw = rng.choice(["NaN", "Infinity", "-Infinity"])
    return Case("numbers", "refuse", f"{field}={raw}", _replace_value(field, raw))


ROPE_BAD = [
    "default",
    ["default"],
    10000,
    True,
    {"rope_type": "foo"},
    {"rope_type": 3},
    {"rope_type": None, "rope_theta": 10000.0},
    {"rope_type": "linear"},
    {"rope_type": "linear", "factor": "2"},
    {"rope_type": "linear", "factor": -2.0},
    {"rope_type": "linear", "factor": 0},
    {"rope_type": "default", "rope_theta": "10000"},
    {"rope_type": "default", "rope_theta": 0},
    {"rope_type": "default", "rope_theta": -1.0},
    {"rope_type": "default", "rope_theta": None},
    {"rope_type": "llama3", "factor": 8.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 4.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 6.5,
    },
    {"rope_type": "yarn"},
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"},
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
    {"rope_type": "longrope", "short_factor": "x", "long_factor": [1.0] * 8},
    {"rope_type": "default", "type": "linear", "factor": 2.0},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
    {"rope_type": "default", "partial_rotary_factor": 0},
    {"rope_type": "default", "partial_rotary_factor": 2},
    {"rope_type": "default", "truncate": "no"},
]
ROPE_OTHER = [  # valid, another model
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 500000.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 10000.0},
    None,
    {},
]
ROPE_SAME = [
    {"type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 10000},
    {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0},
]


def _c_rope(rng):
    field = rng.choice(["rope_parameters", "rope_parameters", "rope_scaling"])
    roll = rng.random()
    if roll < 0.7:
        value, expect = rng.choice(ROPE_BAD), "refuse"
    elif roll < 0.85 or field == "rope_scaling":
        value, expect = rng.choice(ROPE_OTHER), "either"
    else:
        value, expect = rng.choice(ROPE_SAME), "pass"
    return Case("rope", expect, f"{field}={value!r}"[:100], _config_text({field: value}))


FLAGS_AND_NAMES = {
    "tie_word_embeddings": (["false", 0, 1, [False]], [True]),
    "attention_bias": (["false", 1, None, True], []),  # true: the biases it promises are absent
    "mlp_bias": (["no", 0, True], []),
    "hidden_act": ([3, "", ["silu"], None], ["gelu", "relu"]),
    "model_type": (["qwen3", "gpt2", "", 3, None, ["llama"], "qwen2", "LLAMA"], ["mistral"]),
    "bos_token_id": (["1", -1, 1.5, [1, "2"], True, [], 2**40], [None, 5, [1, 2]]),
    "eos_token_id": (["2", -2, {"id": 2}, [2, None]], [[2, 3], None]),
    "layer_types": ([["full_attention"], ["bogus", "bogus"], "full_attention", [1, 2]], [["full_attention"] * 2]),
    "dtype": ([3, [], ""], ["bfloat16", None]),
    "use_cache": (["yes", 1], [False]),
    "partial_rotary_factor": ([0.5, 0, 2, "1"], []),
    "sliding_window": ([0, -5, "5", 5.5], [None]),
}


def _c_flags_and_names(rng):
    field = rng.choice(list(FLAGS_AND_NAMES))
    bad, other = FLAGS_AND_NAMES[field]
    if other and rng.random() < 0.3:
        value = rng.choice(other)
        return Case("flags-names", "either", f"{field}={value!r}", _config_text({field: value}))
    value = rng.choice(bad)
    return Case("flags-names", "refuse", f"{field}={value!r}", _config_text({field: value}))


def _c_file(rng):
    text = _config_text({})
    how = rng.choice(["syntax", "utf8", "array", "duplicate", "duplicate-same", "deep", "huge-deep", "empty", "bom"])
    if how == "syntax":
        i = rng.choice([i for i, c in enumerate(text) if c in '{}[]:,"'])
        text = text[:i] + text[i + 1 :]
    elif how == "utf8":
        return Case("file", "refuse", how, text.encode().replace(b'"llama"', b'"ll\xffama"'))
    elif how == "array":
        text = "[" + text + "]"
    elif how == "duplicate":
        text = text[:-1] + ', "num_attention_heads": 8}'
    elif how == "duplicate-same":
        text = text[:-1] + ', "num_attention_heads": 4}'
    elif how == "deep":
        text = text[:-1] + ', "x": ' + "[" * 40 + "]" * 40 + "}"
    elif how == "huge-deep":
        text = text[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"
    elif how == "empty":
        text = ""
    else:
        return Case("file", "refuse", how, b"\xef\xbb\xbf" + text.encode())
    return Case("file", "refuse", how, text)


def _c_equivalent(rng):
    how = rng.choice(["reorder", "indent", "unknown-field", "mild-nesting", "restate-theta", "drop-optional"])
    config = dict(CONFIG)
    if how == "reorder":
        items = list(config.items())
        rng.shuffle(items)
        return Case("equivalent", "pass", how, json.dumps(dict(items)))
    if how == "indent":
        return Case("equivalent", "pass", how, json.dumps(config, indent=rng.choice([1, 2, 8])))
    if how == "unknown-field":
        config["fuzz_note"] = rng.choice([1, "x", None, [1, {"a": 2}]])
    elif how == "mild-nesting":
        config["fuzz_nest"] = json.loads("[" * 10 + "]" * 10)
    elif how == "restate-theta":
        config["rope_theta"] = 10000.0
    else:
        config.pop(rng.choice(["pad_token_id", "architectures", "transformers_version", "use_cache", "dtype"]))
    return Case("equivalent", "pass", how, json.dumps(config))


def _c_random_int(rng):
    """A random integer in a random int field: equal to the original passes, anything else is refused."""
    field = rng.choice([f for f in INT_FIELDS if f != "max_position_embeddings"])
    value = rng.choice([rng.randrange(-3, 300), CONFIG[field]])
    expect = "pass" if value == CONFIG[field] else "refuse"
    if field == "head_dim" and value == CONFIG["hidden_size"] // CONFIG["num_attention_heads"]:
        expect = "pass"
    return Case("random-int", expect, f"{field}={value}", _config_text({field: value}))


CONFIG_MUTATIONS = {
    _c_int_type: 40,
    _c_int_range: 30,
    _c_int_value: 25,
    _c_null_or_absent: 25,
    _c_numbers: 20,
    _c_number_constants: 10,
    _c_rope: 50,
    _c_flags_and_names: 50,
    _c_file: 25,
    _c_equivalent: 20,
    _c_random_int: 25,
}


def config_cases(rng: random.Random) -> list[Case]:
    cases = [mutate(rng) for mutate, n in CONFIG_MUTATIONS.items() for _ in range(n)]
    rng.shuffle(cases)
    return cases


@pytest.mark.slow
def test_config_mutations(tmp_path):
    rng = random.Random(SEED + 1)
    cases = config_cases(rng)
    work = tmp_path / "configs"
    (work / "src").mkdir(parents=True)
    shutil.copy(TINY_LLAMA / "model.safetensors", work / "src" / "model.safetensors")
    tally = Tally("config.json mutations")
    for case in cases:
        text = case.payload
        (work / "src" / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        run_conversion(case, work, tally)
    tally.report()
    tally.check(N_CONFIG)
    assert tally.total(expect="refuse") > 200 and tally.total("ok", "refuse") == 0
