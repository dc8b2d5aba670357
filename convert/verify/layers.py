"""Per-layer verification, streamed: one original decoder layer in memory at a time (docs/design.md, "Verification").

The original attention (transformers' own module, or the seed's `MyGQA`) and the converted `MLAAttention` see the same
inputs: the hidden states that really reach the layer when token ids are given, else random N(0, 1) (post-norm scale).
"""

from typing import cast

import torch

from convert.mla.attention import MLAAttention, build_mla_attention
from convert.stream import LayerStream, load_module, materialize
from convert.verify.run import VerifyRun
from convert.verify.seed import MyGQA


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max abs error), computed in float64."""
    diff = got.double() - ref.double()
    norm = ref.double().norm()
    return float(diff.norm() / norm) if norm > 0 else float(diff.norm()), float(diff.abs().max())


def _mla_module(run: VerifyRun, layer: int, rotary=None) -> MLAAttention:
    mla = run.mla
    assert mla is not None  # the per-layer check runs on a native checkpoint, which has its `mla` section
    build = lambda: build_mla_attention(mla, layer, rotary=rotary, dtype=run.dtype)
    return cast(MLAAttention, materialize(build, run.converted, run.prefix(layer), run.device, run.dtype))


def check_hf_layers(run: VerifyRun, token_ids: torch.Tensor | None, n_tokens: int, progress) -> list[dict]:
    """Per-layer errors of a transformers family (every registered family but the seed's notation)."""
    mla = run.mla
    assert mla is not None  # the per-layer check runs on a native checkpoint, which has its `mla` section
    stream = LayerStream(run.original, run.config, run.device, run.dtype)
    results = []

    def compare(layer, x, reference, inputs):
        positions, rotary, mask = inputs
        with torch.no_grad():
            ref = reference(x, position_embeddings=rotary, attention_mask=mask)[0]
            got = _mla_module(run, layer, stream.layer_rotary(layer))(x, rotary, mask, position_ids=positions)[0]
            twin = None
            if run.twin is not None:
                twin = stream.attention(layer, run.twin)(x, position_embeddings=rotary, attention_mask=mask)[0]
        results.append(_layer_result(run, layer, got, ref, twin))

    if token_ids is not None:
        for layer, x, decoder, inputs in stream.run(token_ids, mla.n_layers, progress):
            compare(layer, x, decoder.self_attn, inputs)
        return results
    generator = torch.Generator().manual_seed(0)
    for layer in progress(range(mla.n_layers)):
        x = torch.randn(1, n_tokens, mla.hidden_size, generator=generator).to(run.device, run.dtype)
        compare(layer, x, stream.attention(layer), stream.inputs(layer, x))
    return results


def check_seed_layers(run: VerifyRun, n_tokens: int, progress) -> list[dict]:
    """Per-layer errors of a seed-notation checkpoint against the seed's MyGQA (x attends to x; tiled head map,
    no mask, no RoPE)."""
    mla = run.mla
    assert mla is not None  # the per-layer check runs on a native checkpoint, which has its `mla` section
    generator = torch.Generator().manual_seed(0)
    results = []
    for layer in progress(range(mla.n_layers)):
        x = torch.randn(1, n_tokens, mla.hidden_size, generator=generator).to(run.device, run.dtype)
        with torch.no_grad():
            ref = _seed_gqa(run, layer, run.original)(x, x)
            got = _mla_module(run, layer)(x)[0]
            twin = None if run.twin is None else _seed_gqa(run, layer, run.twin)(x, x)
        results.append(_layer_result(run, layer, got, ref, twin))
    return results


def _seed_gqa(run: VerifyRun, layer: int, weights) -> MyGQA:
    """The seed's MyGQA of `layer` with the tensors of `weights` (the original, or its twin)."""
    mla = run.mla
    assert mla is not None  # a seed-notation checkpoint converts to the native format
    d, hidden = mla.head_dim, mla.hidden_size
    module = MyGQA(hidden, hidden, d, d, mla.n_heads, mla.n_kv_heads)
    return cast(MyGQA, load_module(module, weights, run.prefix(layer), run.device, run.dtype))


def _layer_result(run: VerifyRun, layer: int, got: torch.Tensor, ref: torch.Tensor, twin=None) -> dict:
    """One layer's row of the report; with the twin's output, its errors as the layer's noise floor."""
    rel, max_abs = relative_error(got, ref)
    floor_rel, floor_max_abs = (None, None) if twin is None else relative_error(twin, ref)
    assert run.mla is not None  # the per-layer check runs on a native checkpoint, which has its `mla` section
    entry = run.mla.layers[layer]
    ranks = entry.ranks
    return {
        "layer": layer,
        "rel_error": rel,
        "max_abs_error": max_abs,
        "floor_rel_error": floor_rel,
        "floor_max_abs_error": floor_max_abs,
        "ranks": ranks,
        "retained_energy": entry.retained_energy,
        "factor_error": entry.factor_error,
    }
