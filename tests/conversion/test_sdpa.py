"""MLAAttention through torch's `scaled_dot_product_attention` (SDPA): equal to its eager path
(`attn_impl = "eager"`, explicit scores) to round-off in both layouts, split and joint latents,
with q/k norms, every kind of mask the module takes, decoding with a latent cache, float64 to
float16; soft-capping (Gemma 2) stays eager; and neither (B, H, L, S) scores nor a per-head copy
of the latent are created."""

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import DynamicCache

import convert
from convert.mla import build_mla_attention, layer_tensors

from conftest import hf_inputs, hf_model, random_ids, rel_err, seed_gqa

LAYOUTS = ("absorbed", "factored")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# SDPA against eager, relative Frobenius: round-off of each dtype (measured: 2e-16, 1e-7, 4e-3, 5e-4)
TOL = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}

# (model_type, overrides): all split latents with RoPE (joint latents: the seed tests below)
CASES = {
    "llama": ("llama", {}),  # GQA 4:2, r_K = r_V
    # G·d = 64 > D = 32: r_K = 64 > r_V = 32, the value latent is zero-padded for the fused kernel
    "wide-kv": ("llama", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=16)),
    "mistral-window": ("mistral", {}),  # sliding window 5 < 12 tokens
    "qwen3-head-norm": ("qwen3", {}),  # q/k norm per head
    "olmo2-whole-norm": ("olmo2", {}),  # q/k norm over the whole projection
}


@functools.cache
def _converted(case: str, layout: str):
    model_type, overrides = CASES[case]
    model = hf_model(model_type, dtype=torch.float64, **overrides)
    return model, convert.convert_state_dict(model.state_dict(), model.config, layout=layout)


def _pair(converted, layer: int, dtype, **kwargs):
    """The same converted layer twice: through SDPA (the default) and eager."""
    mla = converted.mla
    sdpa = build_mla_attention(mla, layer, layer_tensors(converted, mla, layer), dtype=dtype, **kwargs)
    eager = copy.deepcopy(sdpa)
    eager.attn_impl = "eager"
    assert sdpa.attn_impl == "sdpa"
    return sdpa, eager


def _mask(inputs, kind: str, dtype):
    """The module's three kinds of attention_mask: transformers' additive float mask, the same as
    booleans (True = attend), or None (the module's own causal mask, with its sliding window)."""
    if kind == "none":
        return None
    additive = inputs["mla_mask"]  # (B, 1, L, S), 0 or the dtype's min
    return additive.to(dtype) if kind == "additive" else additive == 0


def _cast(inputs, dtype):
    cos, sin = inputs["position_embeddings"]
    return inputs["x"].to(dtype), (cos.to(dtype), sin.to(dtype))


@pytest.mark.parametrize("mask", ["additive", "boolean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_equals_eager(case, layout, dtype, mask):
    model, converted = _converted(case, layout)
    inputs = hf_inputs(model)
    window = getattr(model.config, "sliding_window", None)
    x, pe = _cast(inputs, dtype)
    outs = []
    for module in _pair(converted, 0, dtype, sliding_window=window):
        with torch.no_grad():
            outs.append(module(x, position_embeddings=pe, attention_mask=_mask(inputs, mask, dtype))[0])
    sdpa, eager = outs
    assert sdpa.dtype == dtype and sdpa.shape == eager.shape
    assert rel_err(sdpa.double(), eager.double()) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_half_precision_is_no_less_accurate_than_eager(layout, dtype):
    """Both against the same weights and inputs in float64: SDPA's kernel keeps the scores in float32
    where eager rounds them to the half dtype before its float32 softmax."""
    model, converted = _converted("llama", layout)
    inputs = hf_inputs(model, length=32)
    x, pe = _cast(inputs, dtype)
    mask = inputs["mla_mask"].to(dtype)
    sdpa, eager = _pair(converted, 0, dtype)
    exact = copy.deepcopy(eager).double()
    with torch.no_grad():
        ref = exact(x.double(), position_embeddings=tuple(t.double() for t in pe), attention_mask=mask.double())[0]
        errors = [rel_err(m(x, position_embeddings=pe, attention_mask=mask)[0].double(), ref) for m in (sdpa, eager)]
    assert errors[0] <= 1.1 * errors[1], f"SDPA {errors[0]:.2e}, eager {errors[1]:.2e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["additive", "none"])
def test_joint_latent_equals_eager(mask, layout, dtype):
    """The seed's (non-causal) GQA with one joint latent serving as keys and values."""
    D, H, G, d = 24, 6, 2, 4
    sd = {f"layers.0.{k}": v for k, v in seed_gqa(D, H, G, d, dtype=torch.float64).state_dict().items()}
    converted = convert.convert_state_dict(sd, None, arch="seed", n_heads=H, latent="joint", layout=layout)
    assert converted.config["mla"]["latent"] == "joint"
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    attn_mask = None
    if mask == "additive":  # a random pattern, every query keeping at least its own key
        keep = (torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(6)) < 0.6) | torch.eye(9, dtype=bool)
        attn_mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    with torch.no_grad():
        sdpa, eager = (m(x, position_embeddings=None, attention_mask=attn_mask)[0] for m in _pair(converted, 0, dtype))
    assert rel_err(sdpa, eager) <= TOL[dtype]


def _decode(module, inputs, chunks, mask_kind, dtype, cache):
    """Run `module` over the sequence in chunks (a prefill, then shorter chunks and single tokens)
    with a latent cache; the concatenated outputs (B, T, D)."""
    x, (cos, sin) = _cast(inputs, dtype)
    outs, start = [], 0
    for stop in chunks:
        # these queries' rows, every column: longer than the S = stop keys, as transformers' masks may be
        rows = inputs["mla_mask"][:, :, start:stop]
        mask = {"additive": rows.to(dtype), "boolean": rows == 0, "none": None}[mask_kind]
        out = module(
            x[:, start:stop],
            position_embeddings=(cos[:, start:stop], sin[:, start:stop]),
            attention_mask=mask,
            past_key_values=cache,
            position_ids=inputs["positions"][:, start:stop],
        )[0]
        outs.append(out)
        start = stop
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("mask", ["additive", "boolean", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["llama", "wide-kv", "mistral-window", "qwen3-head-norm"])
def test_decode_with_a_latent_cache_equals_eager(case, layout, dtype, mask):
    """Prefill 6 tokens, a chunk of 3 against cached keys (the causal mask is no longer SDPA's
    top-left `is_causal`), then single tokens (heads folded into the query length)."""
    model, converted = _converted(case, layout)
    if mask == "none" and getattr(model.config, "sliding_window", None):
        pytest.skip("a single token with no mask attends to every cached key: the window needs the mask")
    inputs = hf_inputs(model, length=12)
    chunks = [6, 9, 10, 11, 12]
    rotary = model.model.rotary_emb.to(dtype)
    outs = []
    for module in _pair(converted, 1, dtype, rotary=rotary):
        with torch.no_grad():
            outs.append(_decode(module, inputs, chunks, mask, dtype, DynamicCache()))
    sdpa, eager = outs
    assert rel_err(sdpa.double(), eager.double()) <= TOL[dtype]
    if dtype == torch.float64:  # and the cached run equals one pass over the whole sequence
        x, pe = _cast(inputs, dtype)
        with torch.no_grad():
            whole = _pair(converted, 1, dtype)[0](x, position_embeddings=pe, attention_mask=inputs["mla_mask"])[0]
        assert rel_err(sdpa, whole) <= TOL[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_left_padding(layout):
    """transformers' additive padding mask (fully masked rows hold the dtype's min, not -inf): SDPA
    equals eager on every row, the padded queries' rows included."""
    model, converted = _converted("llama", layout)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    inputs = hf_inputs(model, padding=padding)
    x, pe = _cast(inputs, torch.float64)
    with torch.no_grad():
        sdpa, eager = (
            m(x, position_embeddings=pe, attention_mask=inputs["mla_mask"])[0]
            for m in _pair(converted, 0, torch.float64)
        )
    assert rel_err(sdpa, eager) <= TOL[torch.float64]


def test_a_fully_masked_boolean_row_gives_zero_where_eager_gives_nan():
    """A query that may see no key at all (boolean mask): eager's softmax over -inf only is NaN;
    SDPA returns zeros there (before the output projection). Other rows agree."""
    model, converted = _converted("llama", "absorbed")
    inputs = hf_inputs(model)
    x, pe = _cast(inputs, torch.float64)
    mask = (inputs["mla_mask"] == 0).clone()
    mask[1, :, 2] = False  # query 2 of sequence 1 sees nothing
    sdpa, eager = _pair(converted, 0, torch.float64)
    sdpa.o_absorbed, eager.o_absorbed = torch.nn.Identity(), torch.nn.Identity()  # the attention itself
    with torch.no_grad():
        got, want = (m(x, position_embeddings=pe, attention_mask=mask)[0] for m in (sdpa, eager))
    assert torch.isnan(want[1, 2]).all() and torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    want[1, 2] = 0
    assert rel_err(got, want) <= TOL[torch.float64]


class _CountSDPA:
    """torch.nn.functional.scaled_dot_product_attention, counting its calls and their query shapes."""

    def __init__(self, monkeypatch):
        self.queries, self._sdpa = [], torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", self)

    def __call__(self, q, *args, **kwargs):
        self.queries.append(tuple(q.shape))
        return self._sdpa(q, *args, **kwargs)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_head_groups(monkeypatch, threads, batch):
    """A decode step folds H = 6 heads into g groups, as many as CPU threads per sequence (a divisor
    of H): with an additive mask, every grouping equals eager."""
    model = hf_model("llama", dtype=torch.float64, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    converted = convert.convert_state_dict(model.state_dict(), model.config, layout="absorbed")
    inputs = hf_inputs(model, batch=batch, length=9)
    count = _CountSDPA(monkeypatch)
    outs, before = [], torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for module in _pair(converted, 0, torch.float64):
            with torch.no_grad():
                outs.append(_decode(module, inputs, [8, 9], "additive", torch.float64, DynamicCache()))
    finally:
        torch.set_num_threads(before)
    groups = {1: 1, 2: 2, 3: 3, 4: 3, 8: 6}[max(1, threads // batch)]
    assert count.queries[-1] == (batch, groups, 6 // groups, converted.config["mla"]["layers"][0]["rank_k"])
    assert rel_err(outs[0], outs[1]) <= TOL[torch.float64]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_converted_model_attends_through_sdpa(monkeypatch, layout):
    """Every layer of a converted model, prefill and each decoded token, calls SDPA: a prefill over
    every head once, in chunks of heads (tests/mla/test_head_chunks.py); an absorbed decode step
    with the heads as the query length of one shared latent."""
    model = hf_model("llama")
    converted = convert.to_mla(model, layout=layout)
    count = _CountSDPA(monkeypatch)
    with torch.no_grad():
        converted.generate(random_ids(1, 8), max_new_tokens=3, do_sample=False, pad_token_id=0)
    H, d = model.config.num_attention_heads, model.config.head_dim
    rank_k = converted.model.layers[0].self_attn.rank_k
    layers = model.config.num_hidden_layers
    prefill, decode = count.queries[: len(count.queries) - 2 * layers], count.queries[-1]
    assert len(prefill) >= layers  # then two cached steps, one call a layer each
    assert sum(q[1] for q in prefill) == layers * H  # every head of every layer once
    assert {(q[0], q[2], q[3]) for q in prefill} == {(1, 8, rank_k if layout == "absorbed" else d)}
    if layout == "absorbed":  # (B, g, H/g, r_K): g work items, one per CPU thread, g divides H
        groups = max(g for g in range(1, min(torch.get_num_threads(), H) + 1) if H % g == 0)
        assert decode == (1, groups, H // groups, rank_k)
    else:
        assert decode == (1, H, 1, d)


def test_soft_capping_stays_eager(monkeypatch):
    """Gemma 2 caps its scores (cap·tanh(scores/cap)), which SDPA cannot express."""
    model = hf_model("gemma2")
    model.config._attn_implementation = "eager"
    converted = convert.to_mla(model)
    assert all(layer.self_attn.softcap == 5.0 for layer in converted.model.layers)
    count = _CountSDPA(monkeypatch)
    with torch.no_grad():
        ids = random_ids()
        assert rel_err(converted(ids).logits, model(ids).logits) <= 1e-5
    assert count.queries == []


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns that owns new memory (views share their
    input's: a stride-0 `expand` of the latent over heads is no copy)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        memory = lambda tree: {t.untyped_storage().data_ptr(): t for t in tree_flatten(tree)[0] if torch.is_tensor(t)}
        inputs = memory((args, kwargs))
        self.shapes += [tuple(t.shape) for ptr, t in memory(out).items() if ptr not in inputs]
        return out


def _op_shapes(module, x, pe, positions, start: int, stop: int):
    """Shapes of the new tensors of one call on tokens start..stop-1, with tokens 0..start-1 cached."""
    cache = DynamicCache()
    run = lambda s: module(
        x[:, s], position_embeddings=(pe[0][:, s], pe[1][:, s]), past_key_values=cache, position_ids=positions[:, s]
    )
    with torch.no_grad():
        run(slice(0, start))
        with _Shapes() as record:
            run(slice(start, stop))
    return record.shapes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["llama", "wide-kv"])
def test_no_per_head_scores_or_latent_copies(case, layout):
    """A chunk of L = 30 queries against S = 70 keys (40 cached), then one decoded token, float32:
    no op returns H·L·S scores or probabilities (eager does: the guard on the guard), and the
    absorbed layout no per-head copy of the (B, 1, S, r_K) key latent (r_K != r_V: padded, not
    left to SDPA's math backend, which builds the scores)."""
    model, converted = _converted(case, layout)
    H, r_k = model.config.num_attention_heads, converted.config["mla"]["layers"][0]["rank_k"]
    inputs = hf_inputs(model, batch=1, length=71)
    x, pe = _cast(inputs, torch.float32)
    sdpa, eager = _pair(converted, 0, torch.float32, rotary=model.model.rotary_emb.float())
    shapes = lambda module, start, stop: _op_shapes(module, x, pe, inputs["positions"], start, stop)

    def scores(shape, L, S):
        return len(shape) >= 2 and shape[-2:] == (L, S) and torch.Size(shape).numel() >= H * L * S

    def latent_copies(shape, S):
        return len(shape) >= 2 and shape[-2:] == (S, r_k) and torch.Size(shape).numel() >= H * S * r_k

    assert any(scores(s, 30, 70) for s in shapes(eager, 40, 70))
    for start, stop in ((40, 70), (70, 71)):
        L, S = stop - start, stop
        found = shapes(sdpa, start, stop)
        assert not any(scores(s, L, S) or scores(s, H * L, S) for s in found), found
        if layout == "absorbed":
            assert not any(latent_copies(s, S) for s in found), found
