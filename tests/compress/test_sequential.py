"""Sequential calibration (`--calibration sequential`): each layer factored on the inputs the model
compressed so far feeds it, its up-projections refit to the original layer's keys and values."""

import json

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main
from convert.linalg.weighted import _refit_up, weighted_factor

from conftest import compression_cli_args, hf_model


def _samples(n=400, dim=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.randn(n, dim, generator=gen, dtype=torch.float64)  # what the original layer sees
    y = y0 + 0.3 * torch.randn(n, dim, generator=gen, dtype=torch.float64)  # what the compressed model feeds
    return y0, y


def test_the_cross_refit_is_the_least_squares_fit_to_the_original_outputs():
    y0, y = _samples()
    w = torch.randn(6, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    down = torch.randn(3, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    moment, cross = y.T @ y / len(y), y0.T @ y / len(y)
    up = _refit_up(w, down, moment, cross)
    # min_up Σ‖W y°ᵢ − up·down yᵢ‖²: ordinary least squares on the samples
    want = torch.linalg.lstsq(y @ down.T, y0 @ w.T).solution.T
    assert torch.allclose(up, want, atol=1e-9)
    same = _refit_up(w, down, moment)  # without a cross moment: the fit to W y on the same inputs
    assert torch.allclose(same, torch.linalg.lstsq(y @ down.T, y @ w.T).solution.T, atol=1e-9)
    assert not torch.allclose(up, same, atol=1e-3)


def test_weighted_factor_refits_with_the_cross_moment():
    y0, y = _samples()
    w = torch.randn(6, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    moment, cross = y.T @ y / len(y), y0.T @ y / len(y)
    plain, refit = weighted_factor(w, 3, None, moment), weighted_factor(w, 3, None, moment, cross)
    assert torch.equal(plain.down, refit.down)  # the latent is the same; only the up-projection moves
    err = lambda f: float((y0 @ w.T - y @ f.down.T @ f.up.T).norm())
    assert err(refit) < err(plain)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["factored", "absorbed"])
def test_layer_zero_is_as_one_shot_and_later_layers_are_refit(layout):
    model = hf_model("llama", num_hidden_layers=3)
    calib = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    # shrinkage 0: the one-shot up-projections are fitted to the shrunk moment, the sequential ones to the
    # moments as measured (solved with their cross moments, docs/compression.md): equal inputs, equal moments
    options = dict(
        layout=layout, kv_cache_ratio=0.5, method="whitened", calib=calib, allocation="uniform", shrinkage=0.0
    )
    one_shot = convert.convert_state_dict(model.state_dict(), model.config, calibration="original", **options)
    sequential = convert.convert_state_dict(model.state_dict(), model.config, calibration="sequential", **options)
    attn = "model.layers.{}.self_attn."
    up = "k_up.weight" if layout == "factored" else "q_absorbed.weight"
    # layer 0 sees the same inputs in both models: the same factors
    for name in (up, "k_down.weight", "v_down.weight"):
        assert torch.allclose(one_shot[attn.format(0) + name], sequential[attn.format(0) + name], atol=1e-6), name
    # layer 2 sees the compressed model's inputs: refit
    assert not torch.allclose(one_shot[attn.format(2) + up], sequential[attn.format(2) + up], atol=1e-4)
    loaded = convert.to_mla(model, calibration="sequential", **options)
    with torch.no_grad():
        assert torch.isfinite(loaded(calib[:, :32]).logits).all()


def test_the_default_is_sequential_in_the_factored_layout_only():
    from convert.options import ConvertOptions

    calib = torch.zeros(1, 8, dtype=torch.long)
    resolved = lambda **kw: ConvertOptions.from_kwargs(kv_cache_ratio=0.5, calib=calib, **kw).resolved_calibration
    assert resolved(layout="factored") == "sequential" and resolved(layout="absorbed") == "original"
    assert resolved(layout="absorbed", calibration="sequential") == "sequential"


def test_cli_sequential_conversion_and_its_refusal(tmp_path):
    args, calib = compression_cli_args(tmp_path)
    result = CliRunner().invoke(
        main, args + ["-o", str(tmp_path / "out"), "--calib", str(calib), "--calibration", "sequential"]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mla"]["compression"]["calibration"] == "sequential"
    refused = CliRunner().invoke(
        main, args + ["-o", str(tmp_path / "svd"), "--method", "svd", "--calibration", "sequential"]
    )
    assert refused.exit_code == 2 and "--calibration sequential" in refused.stderr
    assert not (tmp_path / "svd").exists()
