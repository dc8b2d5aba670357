"""A source's geometry read as transformers reads it: the published configs' gaps filled by its defaults."""

from convert.arch import geometry

# Qwen2.5-Coder-1.5B's config.json as published: no head_dim
QWEN25_15B = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2}
# Gemma 3 270M's: a head_dim that is not hidden_size // num_attention_heads (640 // 4 = 160)
GEMMA3_270M = {"hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256}


def test_head_dim_defaults_to_hidden_size_over_heads_only_when_config_has_none():
    assert geometry.head_dim(QWEN25_15B) == 128
    assert geometry.head_dim(GEMMA3_270M) == 256
    assert geometry.head_dim({**QWEN25_15B, "head_dim": None}) == 128  # written as null


def test_kv_heads_default_to_one_per_query_head():
    assert geometry.n_kv_heads(QWEN25_15B) == 2
    assert geometry.n_kv_heads({"hidden_size": 768, "num_attention_heads": 12}) == 12


def test_head_dim_is_unknown_without_the_fields_it_defaults_from():
    assert geometry.head_dim_if_known({"num_attention_heads": 12}) is None
    assert geometry.head_dim_if_known({"head_dim": 64}) == 64
    assert geometry.head_dim_if_known(QWEN25_15B) == 128
