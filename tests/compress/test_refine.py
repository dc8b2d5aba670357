"""Attention-output refinement (`--refine-steps`): each compressed layer fitted by Adam to the
original layer's attention output on the calibration text, kept only where it measures better."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.compress import sequential
from convert.compress.refine import (
    REFINE_QUERIES,
    REFINE_STEPS,
    Refined,
    Refinement,
    _at_queries,
    _attention_inputs,
    refine_attention,
)
from convert.compress.sequential import SequentialCalibration
from convert.mla.attention import build_mla_attention, layer_tensors
from convert.mla.config import MLASection
from convert.mla.model import build_mla_model
from convert.source import StateDictSource
from convert.stream import LayerStream, layer_output

from conftest import compression_cli_args, hf_model


class _Linear(torch.nn.Module):
    """A stand-in attention: a linear map, called as transformers calls self_attn."""

    def __init__(self, seed: int):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        torch.nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, hidden_states, attention_mask=None):
        return self.proj(hidden_states), None


def _fit_problem():
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))  # (B windows, L, D)
    target = _Linear(seed=1)(x)[0].detach()
    return {"hidden_states": x, "attention_mask": None}, target


def test_refinement_fits_the_output_and_is_deterministic():
    kwargs, target = _fit_problem()
    how = Refinement(steps=200, lr=3e-2, seed=3)
    first, second = _Linear(seed=2), _Linear(seed=2)
    got = refine_attention(first, kwargs, target, how)
    assert got.after < 0.1 * got.before  # a linear map is reachable: the error falls by > 10×
    refine_attention(second, kwargs, target, how)
    assert torch.equal(first.proj.weight, second.proj.weight)  # the same seed, the same tensors
    assert not first.proj.weight.requires_grad


class _Layer(torch.nn.Module):
    """A stand-in decoder layer: the residual stream plus its attention, then a frozen nonlinear map."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.self_attn, self.mlp = attention, torch.nn.Linear(8, 8, bias=False)
        torch.nn.init.normal_(self.mlp.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.self_attn(hidden_states)[0]
        return hidden_states + torch.tanh(self.mlp(hidden_states))


def test_refinement_within_a_layer_fits_the_layers_output_and_trains_only_the_attention():
    kwargs, _ = _fit_problem()
    with torch.no_grad():
        target = _Layer(_Linear(seed=1))(**kwargs)  # the layer with the reachable attention
    layer = _Layer(_Linear(seed=2))
    mlp = layer.mlp.weight.clone()
    got = refine_attention(
        layer.self_attn, kwargs, target, Refinement(steps=200, lr=3e-2), within=layer, base=kwargs["hidden_states"]
    )
    assert got.after < 0.1 * got.before
    assert torch.equal(layer.mlp.weight, mlp)  # the rest of the layer left as it was
    assert not any(p.requires_grad for p in layer.parameters())


def test_a_refinement_that_makes_things_worse_is_undone():
    kwargs, target = _fit_problem()
    module = _Linear(seed=1)  # near the target: steps of 1.0 can only throw it away
    with torch.no_grad():
        module.proj.weight.add_(1e-3 * torch.randn(8, 8, generator=torch.Generator().manual_seed(4)))
    start = module.proj.weight.clone()
    got = refine_attention(module, kwargs, target, Refinement(steps=5, lr=1.0))
    assert 0 < got.before == got.after
    assert torch.equal(module.proj.weight, start)


@pytest.mark.parametrize("lr", [3e-2, 1.0])  # kept (the error falls), undone (steps of 1.0 throw it away)
def test_the_output_kept_is_the_layers_output_as_kept(lr):
    """`keep_output`: the forward that measured `after` is what the sequential calibration advances
    its compressed stream with, so it must be the layer's output with the tensors as they come back."""
    kwargs, _ = _fit_problem()
    with torch.no_grad():
        target = _Layer(_Linear(seed=1))(**kwargs)
    layer = _Layer(_Linear(seed=1) if lr == 1.0 else _Linear(seed=2))
    how = Refinement(steps=20, lr=lr)
    got = refine_attention(layer.self_attn, kwargs, target, how, within=layer, keep_output=True)
    assert (got.after < got.before) == (lr < 1.0)
    with torch.no_grad():
        assert torch.equal(got.output, layer(**kwargs))
    assert refine_attention(layer.self_attn, kwargs, target, how, within=layer).output is None


def test_the_decision_reads_the_first_checked_windows():
    """`Refinement.checked`: the error before and after, which decides whether the fit is kept, is that
    of the first windows (the after forward runs on every window only where the output is kept)."""
    kwargs, _ = _fit_problem()
    with torch.no_grad():
        target = _Layer(_Linear(seed=1))(**kwargs)
    layer = _Layer(_Linear(seed=2))
    with torch.no_grad():
        first = layer(**{**kwargs, "hidden_states": kwargs["hidden_states"][:2]})
    scale = (target[:2] - kwargs["hidden_states"][:2]).pow(2).sum()
    how = Refinement(steps=20, lr=3e-2, checked=2)
    got = refine_attention(layer.self_attn, kwargs, target, how, within=layer, base=kwargs["hidden_states"])
    assert got.before == pytest.approx(float((first - target[:2]).pow(2).sum() / scale), rel=1e-6)
    with torch.no_grad():
        now = layer(**{**kwargs, "hidden_states": kwargs["hidden_states"][:2]})
    assert got.after == pytest.approx(float((now - target[:2]).pow(2).sum() / scale), rel=1e-6)
    assert got.after < got.before


def test_the_attention_inputs_are_read_without_running_the_rest_of_the_layer():
    kwargs, _ = _fit_problem()
    layer = _Layer(_Linear(seed=2))
    calls = []
    layer.mlp.register_forward_hook(lambda *args: calls.append(1))
    assert torch.equal(_attention_inputs(layer, layer.self_attn, kwargs), kwargs["hidden_states"])
    assert not calls  # stopped at the attention: neither it nor the MLP ran


def test_no_steps_leaves_the_layer_as_it_is():
    """steps 0 (`--refine-steps 0`): the error measured, nothing trained (the schedule of zero steps
    divided by zero)."""
    kwargs, target = _fit_problem()
    module = _Linear(seed=2)
    start = module.proj.weight.clone()
    got = refine_attention(module, kwargs, target, Refinement(steps=0))
    assert 0 < got.before == got.after and torch.equal(module.proj.weight, start)


def _logit_error(state, model, ids) -> float:
    with torch.no_grad():
        want = model(ids).logits
        got = build_mla_model(state.config, dict(state), torch.float32)(ids).logits
    return float((got - want).pow(2).mean() / want.pow(2).mean())


@pytest.mark.parametrize(
    ("family", "layout"),
    # Llama adds the attention's output to the residual stream as it is (the goal takes the drift in), OLMo 2 norms it
    # first (the goal leaves the streams' drift out)
    [("llama", "factored"), ("llama", "absorbed"), ("olmo2", "factored")],
)
@pytest.mark.slow
@pytest.mark.parametrize("queries", [64, 512])  # some of each 512-token window's positions a step, or all
def test_refined_conversion_is_closer_to_the_original_on_unseen_tokens(family, layout, queries, request):
    if (family, layout, queries) == ("llama", "absorbed", 512):
        # measured (shrinkage 0.05): plain 1.2558, refined 1.2568 on the unseen ids, while the calibration
        # window's error falls 1.133 -> 0.888 (100 steps: 0.655, unseen 1.270): the absorbed layout's
        # refinement overfits one 512-token window when it fits every position. Its keep-check is on the
        # windows it trained on and cannot see it (issue 65's note); strict: a fix makes this pass
        request.applymarker(pytest.mark.xfail(strict=True, reason="absorbed refinement overfits one window"))
    model = hf_model(family, num_hidden_layers=3)
    gen = torch.Generator().manual_seed(1)
    calib, unseen = torch.randint(0, 128, (1, 512), generator=gen), torch.randint(0, 128, (2, 64), generator=gen)
    options = dict(layout=layout, kv_cache_ratio=0.5, method="whitened", calib=calib, calib_tokens=512)
    options["refine_queries"] = queries
    plain = convert.convert_state_dict(model.state_dict(), model.config, refine_steps=0, **options)
    refined = convert.convert_state_dict(model.state_dict(), model.config, refine_steps=40, **options)
    assert plain.config["mla"]["compression"]["refine_steps"] == 0
    assert refined.config["mla"]["compression"]["refine_steps"] == 40
    assert refined.config["mla"]["compression"]["refine_queries"] == queries
    assert _logit_error(refined, model, unseen) < _logit_error(plain, model, unseen)
    again = convert.convert_state_dict(model.state_dict(), model.config, refine_steps=40, **options)
    assert all(torch.equal(refined[name], again[name]) for name in refined)  # deterministic


def test_the_default_is_sized_to_the_device_and_recorded():
    model = hf_model("llama", num_hidden_layers=1)
    calib = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    state = convert.convert_state_dict(model.state_dict(), model.config, kv_cache_ratio=0.5, calib=calib)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compression = state.config["mla"]["compression"]
    assert compression["refine_steps"] == REFINE_STEPS[device] == Refinement.sized(None).steps
    assert compression["refine_queries"] == REFINE_QUERIES[device] == Refinement.sized(None).queries


def test_cli_refine_steps_and_its_refusals(tmp_path):
    args, calib = compression_cli_args(tmp_path, num_hidden_layers=2)
    result = CliRunner().invoke(
        main, args + ["-o", str(tmp_path / "out"), "--calib", str(calib), "--refine-steps", "7"]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mla"]["compression"]["refine_steps"] == 7
    refusals = [
        (["--calib", str(calib), "--refine-steps", "-1"], "--refine-steps -1"),
        (["--calib", str(calib), "--refine-queries", "0"], "--refine-queries 0"),
        (
            ["--target", "transformers", "--refine-queries", "64"],  # it calibrates nothing it could refine
            "--refine-queries: only for --target mla",
        ),
        (["--method", "svd", "--refine-steps", "5"], "--refine-steps fits each layer"),
    ]
    for bad, message in refusals:
        refused = CliRunner().invoke(main, args + ["-o", str(tmp_path / "bad")] + bad)
        assert refused.exit_code == 2 and message in refused.stderr, refused.output
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_the_goal_is_the_original_stream_where_the_attention_output_enters_it_as_it_is(family, monkeypatch):
    """The compressed decoder layer, on the compressed stream, is fitted to a stream. Llama adds the attention's
    output to the residual stream as it is: the goal is the original's stream after the layer (the drift so far is
    taken back, through the MLP). OLMo 2 norms the output first, as Gemma does (where taking the drift back through
    the norm measured far worse on Gemma 3): the compressed stream plus what the original layer adds to its own."""
    model = hf_model(family, num_hidden_layers=2)
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    config = model.config.to_dict()
    calibration = SequentialCalibration(
        StateDictSource(model.state_dict(), config), config, ids, refinement=Refinement(1)
    )
    gen = torch.Generator().manual_seed(3)
    original = calibration.original
    compressed = calibration.compressed = original + 0.1 * torch.randn(original.shape, generator=gen)  # drifted
    seen = {}

    def record(attention, kwargs, target, how, within=None, base=None, keep_output=False):
        seen.update(kwargs=kwargs, target=target, within=within, base=base, output=torch.randn(target.shape))
        return Refined(0.0, 0.0, seen["output"] if keep_output else None)

    monkeypatch.setattr(sequential, "refine_attention", record)
    calibration._load(0)
    calibration.advance_with(0, calibration.decoder.self_attn, refine=True)  # the original attention stands in
    assert torch.equal(seen["kwargs"]["hidden_states"], compressed)  # fitted on the compressed stream
    assert isinstance(seen["within"], calibration.stream.decoder_cls)  # through the whole decoder layer
    assert calibration.compressed is seen["output"]  # the stream advances with the output the refinement kept
    assert calibration.refined[-1].output is None  # and the record of each layer does not hold it
    added = calibration.original - original  # what the original layer adds to its own stream
    assert not torch.allclose(calibration.original, compressed + added)  # the two goals differ here
    if family == "llama":
        assert torch.equal(seen["target"], calibration.original) and torch.equal(seen["base"], original)
    else:
        assert torch.allclose(seen["target"], compressed + added) and torch.equal(seen["base"], compressed)


@pytest.mark.parametrize(
    ("family", "layout", "ratio"),
    # RoPE in both layouts, compressed and exact; q/k norms per head (Qwen 3) and over the projection (OLMo 2);
    # soft-capped scores through explicit scores and a sliding window (Gemma 2), a sliding layer (Gemma 3), partial RoPE
    [
        ("llama", "factored", 0.5),
        ("llama", "absorbed", 0.5),
        ("qwen3", "factored", 0.5),
        ("olmo2", "absorbed", 1.0),
        ("gemma2", "factored", 1.0),
        ("gemma3_text", "factored", 0.5),
        ("qwen3", "absorbed", 1.0),
        ("phi3", "factored", 1.0),
    ],
)
@pytest.mark.parametrize("mask", ["given", "none"])  # the sequential calibration's mask, or the module's own
def test_a_decoder_layer_at_some_query_positions_computes_what_it_does_there_on_the_whole_window(
    family, layout, ratio, mask
):
    """`Refinement.queries`: a step fits some positions' queries, each attending to every key of its window,
    so the decoder layer run on those positions alone (`_at_queries`, the keys from the attention's input on
    the whole window) must compute what it computes there on the whole window."""
    model = hf_model(family, dtype=torch.float64)
    config = model.config.to_dict()
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(4))
    options = dict(layout=layout, kv_cache_ratio=ratio, refine_steps=0, dtype="float64")
    state = convert.convert_state_dict(model.state_dict(), model.config, **options, **_calibrated(ratio, ids))
    stream = LayerStream(StateDictSource(model.state_dict(), config), config, torch.device("cpu"), torch.float64)
    decoder = stream.decoder(0)
    window = getattr(decoder.self_attn, "sliding_window", None)
    mla = MLASection.from_dict(state.config["mla"])
    tensors = layer_tensors(dict(state), mla, 0)
    decoder.self_attn = build_mla_attention(mla, 0, tensors, rotary=stream.layer_rotary(0), sliding_window=window)
    x = torch.randn(2, 24, config["hidden_size"], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    positions, rotary, causal = stream.inputs(0, x)
    kwargs = dict(hidden_states=x, attention_mask=causal if mask == "given" else None, position_embeddings=rotary)
    kwargs["position_ids"] = positions
    at = torch.tensor([0, 3, 4, 11, 23])  # the first, the last, and some past Gemma's window of 6
    with torch.no_grad():
        whole = layer_output(decoder(**kwargs))  # (B, L, D)
        keys = _attention_inputs(decoder, decoder.self_attn, kwargs)  # (B, L, D): the layer stopped there
        part = layer_output(decoder(**_at_queries(kwargs, at, keys, window)))  # (B, 5, D)
    torch.testing.assert_close(part, whole[:, at], rtol=1e-12, atol=1e-12)


def _calibrated(ratio: float, ids: torch.Tensor) -> dict:
    """Calibration options for a compressed conversion (none for an exact one)."""
    return {} if ratio == 1.0 else dict(method="whitened", calib=ids, calib_tokens=ids.shape[-1])
