"""Compression below the exact rank: budgets, weighting, and the lossy round trip."""

import json

import pytest
import torch
from click.testing import CliRunner
from make_tiny import tiny_hf_model

import convert
from convert.cli import main
from convert.compress.allocate import Latent, allocate_global
from convert.linalg.weighted import weighted_factor, weighted_rope_factor

from conftest import PROSE, hf_model

METHODS = ["svd", "whitened", "fisher"]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny"
    tiny_hf_model("llama").save_pretrained(path)
    calib, text = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text(PROSE)
    text.write_text(PROSE[::-1])
    return path, calib, text


def test_allocation_spends_the_budget_exactly_with_pair_costs():
    latents = [
        Latent(0, "rank_k", torch.tensor([4.0, 3.0, 1.0, 0.5]), cost=2),
        Latent(0, "rank_v", torch.tensor([5.0, 1.0, 0.1]), cost=1),
        Latent(1, "rank_k", torch.tensor([1.0, 1.0, 1.0, 1.0]), cost=2),
        Latent(1, "rank_v", torch.tensor([9.0, 0.01, 0.01]), cost=1),
    ]
    for budget in range(6, 15):
        ranks = allocate_global(latents, budget)
        spent = sum(r["rank_k"] + r["rank_v"] for r in ranks)
        assert spent == budget, (budget, ranks)
        assert all(r["rank_k"] % 2 == 0 for r in ranks)


def test_allocation_prefers_the_components_that_carry_more():
    flat = Latent(0, "rank_v", torch.ones(8), cost=1)
    peaked = Latent(1, "rank_v", torch.tensor([10.0] + [0.1] * 7), cost=1)
    ranks = allocate_global([flat, peaked], 8)
    assert ranks[0]["rank_v"] > ranks[1]["rank_v"]


def test_weighted_factors_are_exact_at_full_rank_and_whitening_helps_when_truncated():
    torch.manual_seed(0)
    w = torch.randn(24, 40, dtype=torch.float64)
    y = torch.randn(2000, 40, dtype=torch.float64) @ torch.randn(40, 40, dtype=torch.float64)  # correlated inputs
    moment = y.T @ y / y.shape[0]
    full = weighted_factor(w, 24, None, moment)
    assert torch.allclose(full.up @ full.down, w, atol=1e-6)
    rope = weighted_rope_factor(w, 3, 24, torch.rand(3, 4, dtype=torch.float64) + 0.5, moment)
    assert torch.allclose(rope.up @ rope.down, w, atol=1e-6)

    def output_error(f):
        return float(((f.up @ f.down - w) @ y.T).norm() / (w @ y.T).norm())

    whitened = weighted_factor(w, 8, None, moment)
    # Eckart–Young in the whitened norm: the error is exactly the discarded weighted spectrum,
    # and no other rank-8 factorization (plain SVD included) does better on these inputs.
    optimum = float((whitened.singular_values[8:] ** 2).sum() / (whitened.singular_values**2).sum()) ** 0.5
    assert output_error(whitened) == pytest.approx(optimum, rel=1e-6)
    assert output_error(whitened) < output_error(weighted_factor(w, 8))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["factored", "absorbed"])
def test_cache_budget_is_met_and_reported(tiny, method, layout):
    src, calib, _ = tiny
    result = convert.gqa2mla(
        src,
        src.parent / "out",
        layout=layout,
        kv_cache_ratio=0.5,
        method=method,
        calib=None if method == "svd" else calib,
        verify=False,
        progress=False,
    )
    comp = result.config["mla"]["compression"]
    mla = result.config["mla"]
    budget = round(0.5 * mla["n_layers"] * 2 * mla["n_kv_heads"] * mla["head_dim"])  # half of 2·G·d per layer
    dims = sum(e["rank_k"] + e["rank_v"] for e in mla["layers"])
    assert comp["budget_dims"] == budget == dims == comp["cache_dims"]
    assert comp["method"] == method and result.sizes["kv_cache_dims_per_token_after"] == budget
    model = convert.load_mla_model(result.output)
    cache = model(torch.tensor([[1, 2, 3, 4]]), use_cache=True).past_key_values
    assert sum(layer.keys.shape[-1] + layer.values.shape[-1] for layer in cache.layers) == budget


def test_ratio_one_is_the_exact_conversion(tiny):
    src, calib, _ = tiny
    result = convert.gqa2mla(src, src.parent / "out", kv_cache_ratio=1.0, calib=calib, progress=False, tokens=32)
    assert result.config["mla"]["compression"] is None and result.passed


@pytest.mark.slow
def test_lossy_round_trip_is_judged_by_max_ppl_ratio(tiny):
    src, calib, text = tiny
    args = [
        "gqa2mla",
        str(src),
        "--kv-cache-ratio",
        "0.5",
        "--calib",
        str(calib),
        "--text",
        str(text),
        "--tokens",
        "256",
        "-q",
    ]
    ok = CliRunner().invoke(main, args + ["-o", str(src.parent / "ok"), "--max-ppl-ratio", "1000"])
    assert ok.exit_code == 0, ok.output
    report = json.loads((src.parent / "ok" / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["end_to_end"]["ppl_ratio"] != 1.0
    assert any(r["rel_error"] > 1e-5 for r in report["layers"])  # honest: the layers are not exact
    gate = report["decision"]["checks"][-1]  # --text's ratio: the gate when --text is given
    assert gate["name"] == f"perplexity ratio on --text {text.name}"
    below = f"{gate['value'] * 0.999:.6f}"  # just under what this conversion measures
    strict = CliRunner().invoke(main, args + ["-o", str(src.parent / "strict"), "--max-ppl-ratio", below])
    assert strict.exit_code == 1
    report = json.loads((src.parent / "strict" / "verification.json").read_text())
    assert report["failures"][0].startswith("perplexity ratio")


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--kv-cache-ratio", "0.5", "--method", "svd"], "--max-ppl-ratio"),
        (["--kv-cache-ratio", "0.5", "--shrinkage", "2", "--no-verify"], "--shrinkage 2"),
        (["--kv-cache-ratio", "0.5", "--rank", "8", "--no-verify"], "--rank and --kv-cache-ratio"),
        (["--kv-cache-ratio", "1.5", "--no-verify"], "--kv-cache-ratio 1.5"),
        (["--kv-cache-ratio", "0.5", "--calib", "nope.txt", "--no-verify"], "--calib nope.txt: no such file"),
    ],
)
def test_bad_compression_requests_exit_2(tiny, extra, fragment):
    src, _, _ = tiny
    res = CliRunner().invoke(main, ["gqa2mla", str(src), "-o", str(src.parent / "out"), *extra])
    assert res.exit_code == 2 and fragment in res.stderr
    assert not (src.parent / "out").exists()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_chunked_calibration_loss_equals_transformers_loss_and_gradient(family):
    """The Fisher pass's loss, computed 7 tokens at a time (no whole-window logits), is the
    model's own summed loss, final soft-cap included (Gemma 2), with the same gradient."""
    from convert.compress.calibrate import summed_loss

    model = hf_model(family, dtype=torch.float64)
    model.config._attn_implementation = "eager"  # transformers soft-caps scores only in eager attention
    if family == "gemma2":
        model.config.final_logit_softcapping = 3.0  # a cap that bites on these logits
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ref_embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)
    ref = model(inputs_embeds=ref_embeds, labels=ids).loss * (ids.shape[-1] - 1)
    ref.backward()
    embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)
    got = summed_loss(model, embeds, ids, chunk=7)
    got.backward()
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    assert float((embeds.grad - ref_embeds.grad).norm() / ref_embeds.grad.norm()) < 1e-6


def test_fisher_pass_computes_no_weight_gradients_and_leaves_the_model_as_it_was():
    from convert.compress import fisher_calibrate

    model = hf_model("llama")
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    stats = fisher_calibrate(model, ids, window=32)
    assert all(s.key_fisher.trace() > 0 and s.value_fisher.trace() > 0 for s in stats)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "olmo2", "gemma3_text", "mixtral"])
def test_streamed_fisher_pass_equals_the_whole_model_pass(family, tmp_path):
    """The Fisher statistics gathered one decoder layer at a time from the checkpoint (forward,
    the loss's gradient in vocabulary chunks, then backward layer by layer from stored inputs)
    are the whole model's backward pass's: input moments, key and value gradient moments, the
    normed keys' moments (q/k norm); soft-capped logits (Gemma 2), post-norm layers (OLMo 2),
    experts (Mixtral) included."""
    from convert.compress import fisher_calibrate
    from convert.compress.calibrate import CalibrationRun, fisher_calibrate_streamed
    from convert.io import open_checkpoint

    model = hf_model(family)
    if family == "gemma2":
        model.config.final_logit_softcapping = 3.0  # a cap that bites on these logits
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    whole = fisher_calibrate(model, ids, window=32)
    config = json.loads((tmp_path / "config.json").read_text())
    with open_checkpoint(tmp_path) as checkpoint:
        streamed = fisher_calibrate_streamed(checkpoint, config, ids, len(whole), CalibrationRun(window=32))
    rel = lambda a, b: float((a - b).norm() / b.norm())
    for ours, theirs in zip(streamed, whole, strict=True):
        assert rel(ours.moment, theirs.moment) < 1e-6 and rel(ours.mean, theirs.mean) < 1e-6
        assert rel(ours.key_fisher, theirs.key_fisher) < 1e-5 and rel(ours.value_fisher, theirs.value_fisher) < 1e-5
        assert (ours.normed_key_moment is None) == (theirs.normed_key_moment is None)
        if theirs.normed_key_moment is not None:
            assert rel(ours.normed_key_moment, theirs.normed_key_moment) < 1e-6


def test_fused_qkv_fisher_pass_is_the_split_projections_one(tmp_path):
    """Phi-3's fused qkv_proj (rows [q | k | v]) gives the key and value gradients' moments of the
    same model written as a Llama with separate q/k/v and gate/up projections (full RoPE): whole
    and streamed. The fused projection has no k_proj to hook (it crashed, exit 4, before)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from convert.compress import fisher_calibrate
    from convert.compress.calibrate import CalibrationRun, fisher_calibrate_streamed
    from convert.io import open_checkpoint

    phi3 = hf_model("phi3", partial_rotary_factor=1.0, dtype=torch.float64)
    c = phi3.config
    llama = LlamaForCausalLM(
        LlamaConfig(
            **{k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")},
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_parameters["rope_theta"],
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=False,
        )
    ).to(torch.float64)
    q, k = c.num_attention_heads * phi3.model.layers[0].self_attn.head_dim, c.num_key_value_heads * 16
    split = {}
    for name, tensor in phi3.state_dict().items():
        if "qkv_proj" in name:
            for proj, part in zip("qkv", tensor.split([q, k, k])):
                split[name.replace("qkv_proj", f"{proj}_proj")] = part
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            split[name.replace("gate_up_proj", "gate_proj")], split[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            split[name] = tensor
    llama.load_state_dict(split)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(phi3(ids).logits, llama(ids).logits, atol=1e-10)  # the same model
    rel = lambda a, b: float((a - b).norm() / b.norm())
    phi3.save_pretrained(tmp_path)
    with open_checkpoint(tmp_path) as checkpoint:
        streamed = fisher_calibrate_streamed(checkpoint, phi3.config.to_dict(), ids, 2, CalibrationRun(window=32))
    for fused in (fisher_calibrate(phi3, ids, window=32), streamed):
        for ours, theirs in zip(fused, fisher_calibrate(llama, ids, window=32), strict=True):
            assert rel(ours.moment, theirs.moment) < 1e-6  # the streamed pass runs in float32
            # eager attention's softmax runs in float32: the gradients agree to its precision
            assert rel(ours.key_fisher, theirs.key_fisher) < 1e-5 and rel(ours.value_fisher, theirs.value_fisher) < 1e-5


def test_the_fisher_statistics_read_the_first_fisher_tokens_and_the_streams_read_them_all():
    model = hf_model("llama", num_hidden_layers=2)
    calib = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(3))  # two windows of 1,024
    first = calib[:, :1024]

    def converted(ids, **options):
        options = dict(kv_cache_ratio=0.5, method="fisher", calib=ids) | options
        return convert.convert_state_dict(model.state_dict(), model.config, **options)

    def same(a, b):
        return all(torch.equal(a[name], b[name]) for name in a)

    # the absorbed layout calibrated on the original's inputs, unrefined: the Fisher pass is all that reads the text
    closed = dict(layout="absorbed", calibration="original", refine_steps=0)
    cut = converted(calib, fisher_tokens=1024, **closed)
    assert same(cut, converted(first, **closed))
    assert not same(cut, converted(calib, fisher_tokens=2048, **closed))
    section = cut.config["mla"]["compression"]
    assert (section["calib_tokens"], section["fisher_tokens"]) == (16384, 1024)
    # the sequential calibration and the refinement run on every calibration token
    streamed = dict(layout="factored", calibration="sequential", refine_steps=5)
    assert not same(converted(calib, fisher_tokens=1024, **streamed), converted(first, **streamed))
