"""A prefill attends to its heads in chunks (`MLAAttention._head_chunks`), so that no temporary is
wider than the original's (tests/mla/test_memory.py). Chunking must change memory only: the same
outputs as all heads at once, in both layouts, compressed, with a q/k norm, with biases, with
padding, and the same gradients (refinement fits modules in eval mode, through the chunks); a
module in training mode runs all heads at once; and a module that is not a plain `nn.Linear` (a
PEFT adapter) is never sliced around."""

import pytest
import torch
from torch import nn

import convert
from convert.mla.attention import MLAAttention

from conftest import hf_model, rel_err

CASES = {
    # name: (family, to_mla options)
    "llama-absorbed": ("llama", dict(layout="absorbed")),
    "llama-factored": ("llama", dict(layout="factored")),
    "llama-absorbed-kv0.5": ("llama", dict(layout="absorbed", kv_cache_ratio=0.5)),
    "llama-factored-kv0.5": ("llama", dict(layout="factored", kv_cache_ratio=0.5)),
    "qwen3-absorbed": ("qwen3", dict(layout="absorbed")),  # a per-head q/k norm
    "qwen2-factored": ("qwen2", dict(layout="factored")),  # q/k/v biases
}
SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)


def _one_chunk(self, length, weights, per_head, budget, modules):
    return [slice(0, self.n_heads)]


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _outputs_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    logits = out.logits
    logits.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_heads_compute_what_all_heads_at_once_do(name, monkeypatch):
    family, options = CASES[name]
    original = hf_model(family, **SHAPE)
    if options.get("kv_cache_ratio"):
        options = options | {"calib": torch.randint(0, original.config.vocab_size, (1, 256)), "refine_steps": 0}
    model = convert.to_mla(original, **options).eval()
    attention = next(m for m in model.modules() if isinstance(m, MLAAttention))
    chunks = attention._head_chunks(12, False, *_budget(attention), _modules(attention))
    assert len(chunks) > 1, f"{name}: a 12-token prefill attends in one chunk, nothing to compare"
    assert [h for c in chunks for h in range(c.start, c.stop)] == list(range(attention.n_heads))
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # the second sequence left-padded: a boolean mask reaches the attention
    inputs = {"input_ids": ids, "attention_mask": padding}
    chunked_out, chunked_grads = _outputs_and_grads(model, inputs)  # eval mode: in chunks
    monkeypatch.setattr(MLAAttention, "_head_chunks", _one_chunk)
    whole_out, whole_grads = _outputs_and_grads(model, inputs)
    assert rel_err(chunked_out, whole_out) < 1e-6
    assert chunked_grads.keys() == whole_grads.keys() and len(whole_grads) > 0
    for param, grad in whole_grads.items():
        assert rel_err(chunked_grads[param], grad) < 1e-5, param


@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_a_training_forward_attends_all_heads_at_once(layout, monkeypatch):
    """Training keeps every head's keys, values and outputs for the backward, so a module in
    training mode runs all heads at once (fewer kernels, less torch.compile time), with or without
    grad (activation checkpointing's first pass). In eval mode a prefill runs in chunks, with or
    without grad (refinement fits modules in eval mode, and keeps the bytes it gave)."""
    model = convert.to_mla(hf_model("llama", **SHAPE), layout=layout)
    counts = []
    chunks_of = MLAAttention._head_chunks

    def counted(self, *args, **kwargs):
        chunks = chunks_of(self, *args, **kwargs)
        counts.append(len(chunks))
        return chunks

    monkeypatch.setattr(MLAAttention, "_head_chunks", counted)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    whole = [1] * model.config.num_hidden_layers
    model.train()(ids).logits.float().pow(2).mean().backward()  # a training step's forward
    assert counts == whole, counts
    counts.clear()
    _logits(model, {"input_ids": ids})  # training mode, no grad: checkpointing's first pass
    assert counts == whole, counts
    counts.clear()
    model.eval()(ids).logits.float().pow(2).mean().backward()  # eval mode, recorded: chunks
    assert min(counts) > 1, counts
    counts.clear()
    _logits(model, {"input_ids": ids})
    assert min(counts) > 1, counts  # eval, no_grad: chunks


def _budget(attention):
    if attention.layout == "absorbed":
        return attention.rank_k, attention.n_heads * attention.head_dim // 2
    return attention.head_dim, attention.n_kv_heads * attention.head_dim


def _modules(attention):
    return (attention.k_up, attention.v_up, attention.o_proj) if attention.layout == "factored" else ()


def test_decode_steps_and_explicit_scores_attend_all_heads_at_once():
    model = convert.to_mla(hf_model("llama", **SHAPE), layout="factored")
    attention = next(m for m in model.modules() if isinstance(m, MLAAttention))
    budget = _budget(attention)
    assert len(attention._head_chunks(12, False, *budget, ())) == attention.n_heads // attention.n_kv_heads
    assert attention._head_chunks(1, False, *budget, ()) == [slice(0, attention.n_heads)]  # decode
    assert attention._head_chunks(12, True, *budget, ()) == [slice(0, attention.n_heads)]  # output_attentions
    attention.attn_impl = "eager"
    assert attention._head_chunks(12, False, *budget, ()) == [slice(0, attention.n_heads)]


def test_a_wrapped_projection_is_called_whole_not_sliced():
    """A module that is not a plain nn.Linear (here a subclass adding to its output, as an adapter
    does) keeps all heads in one chunk, so the module runs and its change reaches the output."""

    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = convert.to_mla(hf_model("llama", **SHAPE), layout="factored").eval()
    attention = next(m for m in model.modules() if isinstance(m, MLAAttention))
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
        wrapped = Shifted(attention.v_up.in_features, attention.v_up.out_features, bias=False)
        wrapped.weight = attention.v_up.weight
        attention.v_up = wrapped
        assert attention._head_chunks(12, False, *_budget(attention), _modules(attention)) == [slice(0, 8)]
        after = model(ids).logits
    assert rel_err(after, before) > 1e-3  # the shift was applied: the module ran
