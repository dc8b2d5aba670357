"""Qwen2 / Qwen2.5 to the `vllm` target: q/k/v biases carried into the weights on the calibration
inputs (`convert.targets.vllm.bias`), an `o_proj` bias (Llama's `attention_bias`) on the attention
outputs, uncalibrated biases refused, the figures in `convert_export`.

The tiny models' token embeddings share one direction, as real hidden states carry nearly constant
directions (what a bias can ride on); reference: the source's own transformers model, against
transformers' DeepseekV3ForCausalLM on the export (`test_target_vllm.exported_model`)."""

import json

import pytest
import torch
from test_target_vllm import calibrate_with, calibrated_stats, exported_model
from tiny_models import HIDDEN, LAYERS, VOCAB, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import convert
from convert.compress.calibrate import LayerStats
from convert.errors import ConvertError
from convert.targets.vllm import ExportChoices, to_vllm_deepseek
from convert.targets.vllm.bias import bias_carrier, output_observer

from conftest import PROSE

CALIB_TOKENS = 512  # more than the hidden size: the carrier is not fitted to fewer points than dims


def tiny_qwen2(n_kv_heads: int = 2, head_dim: int = 64, biased: str = "qkv", seed: int = 0) -> Qwen2ForCausalLM:
    """A Qwen2 with random biases on the projections named in `biased` (zero elsewhere)."""
    return _biased(Qwen2ForCausalLM, tiny_config(Qwen2Config, n_kv_heads, head_dim), biased, seed)


def tiny_biased_llama(n_kv_heads: int = 2, biased: str = "qkvo", seed: int = 0) -> LlamaForCausalLM:
    """A Llama with `attention_bias` (q, k, v and o_proj biases), random on those in `biased`."""
    return _biased(LlamaForCausalLM, tiny_config(LlamaConfig, n_kv_heads, attention_bias=True), biased, seed)


def _biased(model_class, config, biased: str, seed: int):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(0.5 * torch.randn_like(param) if name.split(".")[-2][0] in biased else 0.0)
        embed = model.model.embed_tokens.weight
        embed += 3.0 * embed.norm(dim=1).mean() * torch.nn.functional.normalize(torch.randn(HIDDEN), dim=0)
    return model


def without_biases(model, projections: str = "qkvo"):
    """The model with its attention biases on `projections` zeroed (what dropping them would export)."""
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if name.endswith("_proj.bias") and name.split(".")[-2][0] in projections:
                param.zero_()
    return twin


def logits_error(model, deepseek, seed: int = 1) -> float:
    """Relative error of the export's logits on ids the calibration never saw."""
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = model(ids).logits, deepseek(ids).logits
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize(
    "biased, n_kv_heads, head_dim",
    [("qkv", 2, 64), ("q", 2, 64), ("k", 2, 64), ("v", 2, 64), ("qkv", 3, 64), ("qkv", 2, 128)],
)
def test_biases_are_carried_into_the_weights(tmp_path, biased, n_kv_heads, head_dim):
    """The export of a biased Qwen2 is closer to it than the same export with the biases dropped: of
    what dropping adds to the loss every export has (its bias-free twin's, vLLM's 64 shared rotary
    dims), carrying keeps at most half; the rest is the key bias's share of that same rotary loss."""
    model = tiny_qwen2(n_kv_heads, head_dim, biased)
    stats = calibrated_stats(model, tmp_path / "biased", tokens=CALIB_TOKENS)
    deepseek, tensors, config, export = exported_model(model, stats)
    carried = logits_error(model, deepseek)
    assert not any(n.endswith(("q_proj.bias", "kv_b_proj.bias")) for n in tensors)  # vLLM reads none
    twin = without_biases(model)
    dropped = logits_error(model, exported_model(twin, stats)[0])
    twin_error = logits_error(twin, exported_model(twin, calibrated_stats(twin, tmp_path / "twin", CALIB_TOKENS))[0])
    figures = f"carried {carried:.5f}, dropped {dropped:.5f}, the bias-free twin's own {twin_error:.5f}"
    assert carried - twin_error <= 0.5 * (dropped - twin_error), figures

    figures = export["attention_biases"]
    assert figures["carried"] == ["q_proj", "k_proj", "v_proj"]  # Qwen2 has all three (zero where not `biased`)
    assert len(figures["left_out_share"]) == LAYERS and all(0 <= s < 1e-3 for s in figures["left_out_share"])
    for proj in "qkv":  # zero where the bias is zero, small where the inputs hold a constant direction
        errors = figures["output_error"][proj + "_proj"]
        assert all(0 <= e < 1e-3 for e in errors) and (proj in biased or max(errors) == 0), (proj, errors)
    assert not export["exact"]


def test_carrier_is_exact_on_a_constant_input_and_reports_what_it_leaves_out():
    """W' = W + b aᵀ reproduces Wx + b on inputs with a constant coordinate; on inputs without
    one it leaves out E[(1 − aᵀx)²] of the bias, as measured."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=gen, dtype=torch.float64)
    weight, bias = (
        torch.randn(5, 8, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    )
    for constant in (True, False):
        inputs = x.clone()
        if constant:
            inputs[:, 0] = 2.0
        stats = LayerStats(inputs.T @ inputs / len(inputs), inputs.mean(0))
        carrier = bias_carrier(stats)
        got, want = inputs @ carrier.carry(weight, bias).T, inputs @ weight.T + bias
        measured = float(((got - want) ** 2).sum(1).mean() / bias.pow(2).sum())
        assert abs(measured - carrier.left_out) < 1e-6 * max(1.0, carrier.left_out)
        if constant:
            assert carrier.left_out < 1e-9 and torch.allclose(got, want, atol=1e-6)
        else:
            assert carrier.left_out > 0.9  # zero-mean inputs: nothing to ride on


@pytest.mark.parametrize("make", [lambda: tiny_qwen2(1, 64, "qkv"), lambda: tiny_biased_llama(1, "o")])
def test_uncalibrated_biases_are_refused(make):
    """Even one key/value head of d = 64 (otherwise exact): the biases need the calibration inputs."""
    model = make()
    with pytest.raises(ConvertError, match="give calib"):
        to_vllm_deepseek(model.state_dict(), model.config, ExportChoices())


def test_an_o_proj_bias_needs_the_attention_outputs_moments():
    """Statistics without `output_observer`'s moments: refused, not dropped."""
    model = tiny_biased_llama(2)
    stats = [LayerStats(torch.eye(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64))] * LAYERS
    with pytest.raises(ValueError, match="o_proj bias"):
        to_vllm_deepseek(model.state_dict(), model.config, ExportChoices(stats=stats))


def output_calibrated_stats(model, tmp_path) -> list:
    """`calibrated_stats` with the attention outputs' moments too, as the API gathers them."""
    return calibrate_with(model, tmp_path, CALIB_TOKENS, output_observer())


@pytest.mark.parametrize("n_kv_heads, biased", [(1, "qkvo"), (2, "qkvo"), (2, "o")])
def test_an_o_proj_bias_is_carried_on_the_attention_outputs(tmp_path, n_kv_heads, biased):
    """Llama's `attention_bias` puts a bias on o_proj too: a constant on the residual, which the
    export has no bias for. Carried into W^O on the attention outputs' moments (with a value bias,
    Σα·b_v = b_v is a constant there; without one, the inputs' constant direction is), it keeps at most
    half of what dropping it adds to the export's own loss (that of the twin without it), and its
    figures are in `convert_export`."""
    model = tiny_biased_llama(n_kv_heads, biased)
    stats = output_calibrated_stats(model, tmp_path / "biased")
    deepseek, tensors, _, export = exported_model(model, stats)
    assert tensors["model.layers.0.self_attn.o_proj.bias"].abs().max() == 0  # vLLM reads none
    carried = logits_error(model, deepseek)
    twin = without_biases(model, "o")
    dropped = logits_error(model, exported_model(twin, output_calibrated_stats(twin, tmp_path / "twin"))[0])
    twin_error = logits_error(twin, exported_model(twin, output_calibrated_stats(twin, tmp_path / "own"))[0])
    figures = f"carried {carried:.5f}, o_proj bias dropped {dropped:.5f}, the twin's own {twin_error:.5f}"
    assert carried - twin_error <= 0.5 * (dropped - twin_error), figures

    biases = export["attention_biases"]
    assert biases["carried"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert len(biases["o_proj_left_out_share"]) == LAYERS
    assert all(0 <= s < 0.1 for s in biases["o_proj_left_out_share"]), biases["o_proj_left_out_share"]
    assert all(0 <= e < 0.1 for e in biases["output_error"]["o_proj"]), biases["output_error"]["o_proj"]


def test_the_api_judges_a_qwen2_export_and_reports_its_biases(tmp_path):
    """`gqa2mla(target="vllm")` on a Qwen2 directory: a lossy export judged by perplexity, the
    biases' figures in config.json and the report's note."""
    model = tiny_qwen2(2, 64, "qkv")
    model.save_pretrained(tmp_path / "src")
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    calib = torch.randint(0, VOCAB, (1, CALIB_TOKENS), generator=torch.Generator().manual_seed(2))
    result = convert.gqa2mla(
        tmp_path / "src", tmp_path / "out", target="vllm", calib=calib, text=text, max_ppl_ratio=1.5, tokens=64,
        progress=False,
    )  # fmt: skip
    assert result.report["decision"]["rule"].startswith("lossy conversion")
    export = json.loads((tmp_path / "out" / "config.json").read_text())["convert_export"]
    assert export["attention_biases"]["carried"] == ["q_proj", "k_proj", "v_proj"]
    assert "biases" in result.report["target"]["note"]


def test_a_key_bias_rides_only_in_the_rotary_slots_that_turn(tmp_path):
    """A key bias b adds q·R b to every score of a query: the same for every key where the export drops
    the rotation (its position-free keys) or where vLLM's slot turns less than a radian over the span,
    so it is left out there; carried on the inputs' nearly constant direction, each key would get its
    own error (Qwen2.5-Coder-1.5B's key biases, norm ~1,200 in its slowest pairs, made its export's
    perplexity ×3.4 million the original's). In a slot that turns it rides in `k_pe`. So a bias in the
    slow pairs leaves every exported tensor as its bias-free twin's; one in the fastest pair moves only
    that slot's rows of the rotary key."""
    from convert.targets.vllm.bias import key_bias_slots
    from convert.targets.vllm.geometry import KV_LORA_RANK
    from convert.targets.vllm.rope import rope_frequencies

    d, fold = 128, 2
    slots = key_bias_slots(rope_frequencies(tiny_qwen2(2, d, "k").config, d)[1], fold, 1024)
    assert slots.any() and not slots.all()  # θ = 10⁴: slots 0-24 turn, 25-31 do not
    gen = torch.Generator().manual_seed(3)
    for biased_slots, name in ((~slots, "slow"), (torch.arange(32) == 0, "fastest")):
        model = tiny_qwen2(2, d, "k")
        with torch.no_grad():
            for layer in model.model.layers:
                bias = layer.self_attn.k_proj.bias.view(2, d)  # (G, d): pair j is dims j and j + d/2
                bias.zero_()
                for slot in biased_slots.nonzero().flatten().tolist():
                    for pair in (fold * slot, fold * slot + 1):
                        bias[:, [pair, pair + d // 2]] = 20.0 * torch.randn(2, 2, generator=gen)
        stats = calibrated_stats(model, tmp_path / name, tokens=CALIB_TOKENS)
        tensors, twin_tensors = (exported_model(m, stats)[1] for m in (model, without_biases(model, "k")))
        moved = [n for n in tensors if not torch.equal(tensors[n], twin_tensors[n])]
        if name == "slow":
            assert moved == [], moved
        else:
            assert sorted(moved) == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(LAYERS)]
            for n in moved:  # slot 0's interleaved rows (512, 513) of the rotary key, nothing else
                rows = (tensors[n] != twin_tensors[n]).any(1).nonzero().flatten().tolist()
                assert rows and set(rows) <= {KV_LORA_RANK, KV_LORA_RANK + 1}, rows
