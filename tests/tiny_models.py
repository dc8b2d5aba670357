"""The tests' one tiny-model helper: two-layer transformers models of a given geometry, seeded, in
eval mode (`fixtures/tiny-llama` is the default checkpoint on disk; this builds variants in memory)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, LAYERS, VOCAB = 192, 2, 128


def tiny_config(config_class, n_kv_heads: int, head_dim: int = 64, **extra):
    """The tests' two-layer source config of `config_class` (a transformers config class)."""
    return config_class(
        hidden_size=HIDDEN,
        num_attention_heads=HIDDEN // head_dim * 2 if head_dim == 64 else 4,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        intermediate_size=64,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        **extra,
    )


def tiny_llama(n_kv_heads: int, head_dim: int = 64, **extra) -> LlamaForCausalLM:
    """A two-layer Llama with `n_kv_heads` key/value heads of `head_dim`, seeded by `n_kv_heads`."""
    torch.manual_seed(n_kv_heads)
    return LlamaForCausalLM(tiny_config(LlamaConfig, n_kv_heads, head_dim, **extra)).eval()
