"""The `vllm` target: a DeepseekV3ForCausalLM in vLLM's MLA shape (kv_lora_rank 512 + 64 rotary dims).

Reference: transformers' own DeepseekV3ForCausalLM built from the exported config (its latent
bias stands in for the latent norm's eps vLLM reads; `match_vllm_norms` leaves it alone), against
the source's own transformers model on the same ids.
"""

import json

import pytest
import torch
from tiny_models import HIDDEN, LAYERS, VOCAB, tiny_llama
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from convert.compress.calibrate import LayerStats
from convert.compress.refine import Refinement
from convert.errors import ConvertError
from convert.targets.vllm import ExportChoices, match_vllm_norms, to_vllm_deepseek

from conftest import PROSE


def identity_stats() -> list[LayerStats]:
    return [LayerStats(torch.eye(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64))] * LAYERS


def exported_model(model, stats=None, **kwargs):
    return exported_model_from(model.state_dict(), model.config, stats, **kwargs)


def exported_model_from(state: dict, config, stats=None, **choices):
    """(transformers' DeepseekV3 on the export, its tensors, its config, its `convert_export`);
    choices: `ExportChoices`' other fields."""
    tensors, config = to_vllm_deepseek(state, config, ExportChoices(stats=stats, **choices))
    export = config.pop("convert_export")
    deepseek = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(config)).eval()
    deepseek.load_state_dict(tensors, strict=True)
    match_vllm_norms(deepseek)
    return deepseek, tensors, config, export


def rel_error(model, deepseek, length: int = 48, seed: int = 1) -> float:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = model(ids).logits, deepseek(ids).logits
    return float((got - want).norm() / want.norm())


def test_config_and_tensor_names():
    model = tiny_llama(3)
    _, tensors, config, export = exported_model(model, identity_stats())
    assert config["model_type"] == "deepseek_v3"
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64
    assert config["q_lora_rank"] is None and config["rope_interleave"] is True
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]
    assert config["attention_bias"] is True  # the latent norm's constant, for transformers only
    names = {n.split("self_attn.")[1] for n in tensors if ".self_attn." in n}
    assert names == {
        "q_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_proj_with_mqa.bias",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
        "o_proj.bias",
    }
    bias = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.bias"]
    assert bias[:510].abs().max() == 0 and (bias[510:512] == 2.0**24).all() and bias[512:].abs().max() == 0
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][510:512].abs().max() == 0
    assert tensors["model.layers.0.self_attn.kv_b_proj.weight"][:, 510:].abs().max() == 0
    assert tensors["model.layers.0.self_attn.o_proj.bias"].abs().max() == 0
    assert "lm_head.weight" in tensors  # written out although the source ties it
    assert export["kv_cache_dims_per_token_per_layer"] == 576
    assert export["gqa_cache_dims_per_token_per_layer"] == 2 * 3 * 64


def test_one_kv_head_is_exact():
    model = tiny_llama(1)
    deepseek, *_ = exported_model(model)
    assert rel_error(model, deepseek) < 1e-5


@pytest.mark.parametrize("n_kv_heads", [2, 3])
def test_proportional_key_heads_are_exact(n_kv_heads):
    """G > 1 key heads that are multiples of one another: one rotary mixture holds them all."""
    model = tiny_llama(n_kv_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.copy_(w[:64].repeat(n_kv_heads, 1) * torch.arange(1, n_kv_heads + 1).repeat_interleave(64)[:, None])
    deepseek, *_ = exported_model(model, identity_stats())
    assert rel_error(model, deepseek) < 1e-5


@pytest.mark.parametrize("n_kv_heads", [2, 3])
def test_general_key_heads_are_lossy_and_bounded(n_kv_heads):
    model = tiny_llama(n_kv_heads)
    deepseek, _, _, export = exported_model(model, identity_stats())
    err = rel_error(model, deepseek)
    assert 1e-5 < err < 0.1  # lossy (rotation of the secondary mixtures dropped), but close
    assert not export["exact"] and all(0 < e < 1 for e in export["rotary_key_energy_kept"])


@pytest.mark.parametrize(
    "make, stats, kwargs, match",
    [
        (lambda: tiny_llama(2), None, {}, "calib"),
        (lambda: tiny_llama(1), None, {"dtype": torch.float16}, "float16"),
        (lambda: tiny_llama(1, head_dim=32), None, {}, "head_dim 32"),
        (lambda: tiny_llama(1, attention_bias=True), None, {}, "attention biases on k_proj, o_proj, q_proj, v_proj"),
        (
            lambda: tiny_llama(1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            None,
            {},
            "rope_type='linear'",
        ),
    ],
)
def test_refusals(make, stats, kwargs, match):
    with pytest.raises(ConvertError, match=match):
        to_vllm_deepseek(make().state_dict(), make().config, ExportChoices(stats=stats, **kwargs))


@pytest.mark.slow
def test_api_writes_a_report_that_says_where_it_is_lossy(tmp_path):
    import convert

    model = tiny_llama(3)
    model.save_pretrained(tmp_path / "src")
    calib = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    with pytest.raises(ConvertError, match="lossy.*text=FILE.*max_ppl_ratio=R"):  # judged by perplexity
        convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="vllm", calib=calib, progress=False)
    assert not (tmp_path / "out").exists()
    result = convert.gqa2mla(
        tmp_path / "src",
        tmp_path / "out",
        target="vllm",
        calib=calib,
        text=text,
        max_ppl_ratio=1.5,
        tokens=64,
        progress=False,
    )
    assert result.report["decision"]["rule"].startswith("lossy conversion")
    target = result.report["target"]
    assert target["cache_values_per_token_per_layer"] == 576 and target["gqa_cache_values_per_token_per_layer"] == 384
    assert target["cache_bytes_per_token"] == 576 * 4 * LAYERS
    assert "LOSSY" in target["note"] and "LARGER" in target["note"]
    assert "Target vllm" in (result.output / "verification.md").read_text()
    with pytest.raises(ConvertError, match="lossy.*max_ppl_ratio=R"):
        convert.gqa2mla(tmp_path / "src", tmp_path / "out2", target="vllm")
    assert not (tmp_path / "out2").exists()
    # without calib: calibrated on the shipped mix, as a compression is, and judged on every kind
    default = convert.gqa2mla(
        tmp_path / "src", tmp_path / "out3", target="vllm", max_ppl_ratio=1.5, tokens=64, progress=False
    )
    assert default.config["convert_export"]["exact"] is False
    judged = [row["text"] for row in default.report["end_to_end"]["by_text"]]
    assert sorted(judged) == ["code", "dialogue", "fiction", "technical"]


@pytest.mark.parametrize("tied", [True, False])
def test_the_api_export_reads_the_source_a_tensor_at_a_time(tmp_path, tied):
    """`LazyTensors`: the export's view of a checkpoint reads a tensor only when asked (shapes and
    dtypes come from the headers), each into its own memory; the export streams into the writer,
    each tensor once, lm_head tied or not."""
    from convert.io import open_checkpoint
    from convert.source import LazyTensors, StateDictSource
    from convert.targets.vllm import vllm_export

    model = tiny_llama(1)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
    model.save_pretrained(tmp_path / "src")
    with open_checkpoint(tmp_path / "src") as checkpoint:
        reads = []
        read = checkpoint.read
        checkpoint.read = lambda name: reads.append(name) or read(name)
        lazy = LazyTensors(checkpoint)
        assert set(lazy) == set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
        view = StateDictSource(lazy, {})
        assert view.shape("model.embed_tokens.weight") == (VOCAB, HIDDEN) and view.dtype("model.norm.weight")
        assert reads == [] and "model.norm.weight" in lazy and "nothing" not in lazy
        with pytest.raises(KeyError):
            lazy["nothing"]
        layout, config, tensors = vllm_export(lazy, model.config.to_dict())
        assert "convert_export" not in config and reads == []  # nothing read before the first tensor
        items = list(tensors)
    assert [name for name, _ in items] == list(layout) and config["convert_export"]["exact"]  # each once
    streamed = dict(items)
    assert all(tuple(t.shape) == layout[name][0] for name, t in streamed.items())
    whole, _ = to_vllm_deepseek(model.state_dict(), model.config)
    assert all(torch.equal(streamed[name], whole[name]) for name in whole)


# ------------------------------------------------------------------ head_dim 128 (folded frequencies) and the latent


def silence_odd_pairs(model, n_kv_heads: int, head_dim: int = 128) -> None:
    """Zero the keys of every odd frequency pair 2s + 1 (rows 2s+1 and 2s+1 + d/2 of each head)."""
    half = head_dim // 2
    odd = torch.arange(1, half, 2)
    rows = torch.cat([g * head_dim + torch.cat([odd, odd + half]) for g in range(n_kv_heads)])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[rows] = 0.0


def test_folded_frequencies_are_exact_when_the_folded_pairs_are_silent():
    """d = 128: vLLM's slot s turns at θ_{2s}; with the keys of every pair 2s + 1 zero the rotary
    key holds pair 2s exactly and nothing is left position-free."""
    model = tiny_llama(1, head_dim=128)
    silence_odd_pairs(model, 1)
    deepseek, _, config, export = exported_model(model, identity_stats())
    assert config["qk_nope_head_dim"] == 128 and config["v_head_dim"] == 128 and config["qk_rope_head_dim"] == 64
    assert export["frequency_fold"] == 2 and not export["exact"]  # lossy in general, exact on these weights
    assert rel_error(model, deepseek) < 1e-5


def test_folded_frequencies_are_lossy_and_bounded():
    model = tiny_llama(2, head_dim=128)
    deepseek, _, _, export = exported_model(model, identity_stats())
    assert 1e-5 < rel_error(model, deepseek) < 0.2
    assert all(0 < e < 1 for e in export["rotary_key_energy_kept"])
    with pytest.raises(ConvertError, match="calib"):  # one key head, but two pairs per rotary slot
        to_vllm_deepseek(tiny_llama(1, head_dim=128).state_dict(), tiny_llama(1, head_dim=128).config)


def test_the_latent_is_exact_while_it_fits_and_compressed_below():
    """G = 3, d = 64: the remainders and values need 320 dims, min(320, D = 192) here. At that
    rank the export equals the one with vLLM's whole 512; below it the latent is compressed,
    and its error shrinks as the rank grows."""
    model = tiny_llama(3)
    full, *_ = exported_model(model, identity_stats())
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = full(ids).logits
    errors = []
    for rank in (48, 96, 144, HIDDEN):
        deepseek, tensors, _, export = exported_model(model, identity_stats(), rank=rank)
        assert export["latent_compressed"] == (rank < HIDDEN) and export["latent_dims_used"] == rank
        assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][rank:512].abs().max() == 0
        with torch.no_grad():
            errors.append(float((deepseek(ids).logits - want).norm() / want.norm()))
    assert errors[-1] < 1e-6 and errors[0] > errors[1] > errors[2] > 1e-4, errors


@pytest.mark.parametrize("mask", [None, "bool"])
def test_the_exports_attention_stands_in_for_the_sources(mask):
    """`ExportAttention` (what sequential calibration runs in the compressed stream) in a source
    decoder layer: for an exact export (one key head of d = 64) it gives the source attention's
    output, with a bool mask or none (transformers' plain causal case)."""
    from convert.targets.vllm.runtime import ExportAttention

    model = tiny_llama(1)
    tensors, config = to_vllm_deepseek(model.state_dict(), model.config, ExportChoices(dtype=torch.float32))
    s = config["convert_export"]["residual_scale"]
    prefix = "model.layers.1.self_attn."
    own = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
    export = ExportAttention(config, 1, own, s)
    x = torch.randn(1, 20, HIDDEN, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(20)[None]
    rotary = model.model.rotary_emb(x, positions)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None] if mask else None
    source = model.model.layers[1].self_attn
    with torch.no_grad():
        want = source(x, position_embeddings=rotary, attention_mask=causal if mask else None)[0]
        got = export(x, attention_mask=causal, position_ids=positions, position_embeddings=rotary)[0]
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_the_exports_attention_takes_some_queries_against_every_key():
    """What a refinement step runs (`convert.compress.refine._at_queries`): some positions' queries against
    the keys of the whole window, with their rows of the mask. A lossy export (two key heads) in a source
    decoder layer gives at those positions what it gives on the whole window, in the layer and alone."""
    from convert.compress.refine import _at_queries
    from convert.targets.vllm.runtime import ExportAttention

    model = tiny_llama(2)
    choices = ExportChoices(stats=identity_stats(), dtype=torch.float32)
    tensors, config = to_vllm_deepseek(model.state_dict(), model.config, choices)
    prefix = "model.layers.1.self_attn."
    own = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
    layer = model.model.layers[1]
    layer.self_attn = ExportAttention(config, 1, own, config["convert_export"]["residual_scale"])
    x = torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(24)[None]
    rows = dict(
        hidden_states=x, attention_mask=None, position_embeddings=model.model.rotary_emb(x, ids), position_ids=ids
    )
    queries = torch.tensor([0, 5, 6, 17, 23])
    with torch.no_grad():  # the keys come from what the attention is called with: the layer's normed input
        subset = _at_queries(rows, queries, layer.input_layernorm(x), None)
        whole, some = layer(**rows), layer(**subset)
        alone = layer.self_attn(**_at_queries(rows, queries, x, None))[0]
        wanted = layer.self_attn(x, position_ids=ids)[0][:, queries]
    assert some.shape == (2, 5, HIDDEN) and torch.allclose(some, whole[:, queries], atol=1e-5)
    assert torch.allclose(alone, wanted, atol=1e-5) and float(wanted.norm()) > 1


@pytest.mark.slow
@pytest.mark.parametrize(("calibration", "refine_steps"), [(None, None), ("sequential", None), (None, 0)])
def test_an_8b_shaped_source_is_compressed_into_the_latent_through_the_api(tmp_path, calibration, refine_steps):
    """Llama-3-8B's attention (G = 8 key heads of d = 128, llama3 RoPE; 16 query heads here,
    D = 1024): 1,984 latent dims needed, 510 held. The API calibrates with Fisher statistics,
    compresses the latent (on the original's inputs by default, or sequentially), refines each
    layer to its attention output (the device's default steps; 0: not at all), writes
    DeepSeek-YaRN, and the report says so."""
    import convert

    torch.manual_seed(8)
    config = LlamaConfig(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_parameters=LLAMA3_ROPE | {"original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    )
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "src")
    calib = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    result = convert.gqa2mla(
        tmp_path / "src",
        tmp_path / "out",
        target="vllm",
        calib=calib,
        calibration=calibration,
        refine_steps=refine_steps,
        text=text,
        max_ppl_ratio=100.0,
        tokens=64,
        progress=False,
    )
    written = json.loads((result.output / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "yarn"
    exported = written["convert_export"]
    assert exported["latent_compressed"] and exported["latent_weighting"] == "fisher"
    assert exported["latent_calibration"] == (calibration or "original")
    assert exported["latent_refine_steps"] == (Refinement.sized(None).steps if refine_steps is None else 0)
    assert exported["latent_content_dims"] == 64 * 15 + 1024 and exported["latent_dims_used"] == 510
    target = result.report["target"]
    assert target["cache_values_per_token_per_layer"] == 576 and target["gqa_cache_values_per_token_per_layer"] == 2048
    assert "COMPRESSED" in target["note"] and "smaller than" in target["note"] and "folds 2" in target["note"]


@pytest.mark.slow
def test_refining_a_compressed_latent_fits_each_layer_and_moves_only_what_vllm_reads(tmp_path):
    """A tiny Llama's latent compressed to a third of what it needs (`ExportChoices(rank=…)`, as
    every 7B+ source's is into vLLM's 512), without and with attention-output refinement: refined,
    every layer's attention-output error on the calibration text falls; only attention tensors
    move, and not the biases vLLM never reads nor the latent norm's rows (`NORM_ROWS`: zero weights,
    what vLLM computes there); the export records the steps. Made with the pieces
    the target calibrates with (`export_statistics`, `latent_sequential`), as the benches make it."""
    from convert.io import open_checkpoint
    from convert.targets.vllm import export_statistics, latent_sequential
    from convert.targets.vllm.export import resolve_vllm_spec
    from convert.targets.vllm.geometry import KV_LORA_RANK, LATENT_DIMS, latent_content_rank

    original = tiny_llama(n_kv_heads=2)
    original.save_pretrained(tmp_path / "src", safe_serialization=True)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    calib = torch.randint(0, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(2))
    exports = {}
    with open_checkpoint(tmp_path / "src") as checkpoint:
        state = {name: checkpoint.get(name) for name in checkpoint.keys()}
        _, view, spec = resolve_vllm_spec(state, config)
        stats = export_statistics(checkpoint, config, view, spec, calib, fisher=False)  # the plain moments
        assert all(layer.key_fisher is None and layer.rotation_fit is not None for layer in stats)
        rank = latent_content_rank(spec) // 3
        for steps in (0, 40):  # each step on 128 query positions of a window, as the target refines
            sequential = latent_sequential(checkpoint, config, calib, "original", Refinement(steps=steps, queries=128))
            assert (sequential is None) == (steps == 0)  # neither refit nor refined: nothing to run
            choices = ExportChoices(stats=stats, rank=rank, sequential=sequential)
            exports[steps], export_config = to_vllm_deepseek(state, config, choices)
            assert export_config["convert_export"]["latent_refine_steps"] == steps
        refined = sequential.calibration.refined
    assert len(refined) == LAYERS and all(layer.after < layer.before for layer in refined), refined
    moved = [name for name in exports[0] if not torch.equal(exports[0][name], exports[40][name])]
    assert moved and all(".self_attn." in name for name in moved)
    assert not any(name.endswith(("kv_a_proj_with_mqa.bias", "o_proj.bias")) for name in moved)
    latents = [t for name, t in exports[40].items() if name.endswith("kv_a_proj_with_mqa.weight")]
    assert len(latents) == LAYERS and all(not t[LATENT_DIMS:KV_LORA_RANK].any() for t in latents)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # short, so that a 96-token text sees the scaled frequencies
    "rope_theta": 10000.0,
}


def calibrated_stats(model, tmp_path, tokens: int = 96) -> list:
    """`calibrate` with the vllm target's rotation-fit observer, on random ids, as the API runs it."""
    return calibrate_with(model, tmp_path, tokens)


def calibrate_with(model, tmp_path, tokens: int, *more) -> list:
    """`calibrated_stats` with the observers `more` beside the rotation fit."""
    from convert.compress.calibrate import calibrate
    from convert.io import open_checkpoint
    from convert.targets.vllm.bias import observers
    from convert.targets.vllm.calibration import rotation_fit_observer
    from convert.targets.vllm.export import resolve_vllm_spec

    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(7))
    with open_checkpoint(tmp_path / "src") as checkpoint:
        _, source, spec = resolve_vllm_spec(model.state_dict(), config)
        observe = observers(rotation_fit_observer(source, spec, config), *more)
        return calibrate(checkpoint, config, ids, LAYERS, observe=observe)


def test_llama3_rope_is_served_as_deepseek_yarn_and_fitted(tmp_path):
    """Llama-3's RoPE (frequencies ÷ 8 at long wavelengths) has no vLLM DeepSeek form; the export
    writes the DeepSeek-YaRN with the same factor and bounds (which vLLM computes as transformers
    does), and the fit corrects where the two blend differently: one key head of d = 64, lossy
    only by that, and the fitted export is closer to the original than the unfitted one on held-out
    ids as long as the calibration's (the fit is to the distances the calibration saw)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from convert.hf import hf_config
    from convert.targets.vllm.rope import rope_frequencies

    model = tiny_llama(1, rope_parameters=LLAMA3_ROPE)
    with pytest.raises(ConvertError, match="calib"):
        to_vllm_deepseek(model.state_dict(), model.config)
    stats = calibrated_stats(model, tmp_path)
    fitted, _, config, export = exported_model(model, stats)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 8.0
    assert export["source_rope_type"] == "llama3" and not export["exact"]
    source_freq, slot_freq = rope_frequencies(hf_config(model.config.to_dict()), 64)
    installed = DeepseekV3RotaryEmbedding(fitted.config).inv_freq.double()
    assert torch.allclose(installed, slot_freq, rtol=1e-6) and not torch.allclose(source_freq, slot_freq, rtol=1e-3)
    unfitted, *_ = exported_model(model, stats, stand_in="nope")
    assert rel_error(model, fitted, 96, seed=11) < rel_error(model, unfitted, 96, seed=11) < 0.2


# ------------------------------------------------------------------ the fitted stand-in for dropped rotations


def _brute_force_equations(q, r, k0, keys, inv_freq, rotary_freq=None, base=None):
    """`fit_normal_equations` pair by pair, as its docstring defines them."""
    L, H, d = q.shape
    half = d // 2
    gram, rhs = torch.zeros(H, 2 * d, 2 * d, dtype=torch.float64), torch.zeros(H, 2 * d, dtype=torch.float64)
    q, r, k0 = q.double(), r.double(), k0.double()

    def rotated(v, phi):  # R(-φ) v with rotate_half's R(φ) = [[cos, -sin], [sin, cos]] on (first, second)
        x, y = v[:half], v[half:]
        return torch.cat([phi.cos() * x + phi.sin() * y, -phi.sin() * x + phi.cos() * y])

    def dot_cross(u, v):
        return torch.cat([u[:half] * v[:half] + u[half:] * v[half:], u[:half] * v[half:] - u[half:] * v[:half]])

    for h in range(H):
        for m in range(L):
            for n in keys[h, m].tolist():
                phi = inv_freq.double() * (m - n)
                phi_rot = phi if rotary_freq is None else rotary_freq.double() * (m - n)
                t = (q[m, h] * rotated(r[n, h], phi)).sum()  # q·R(-φ)r over every pair
                if base is not None:  # what turning k0 at φ' instead of φ misses, for the base coefficients
                    miss = q[m, h] * (rotated(k0[n], phi) - rotated(k0[n], phi_rot))  # (d,)
                    t = t + (base[h].double().repeat(2) * miss).sum()
                f = torch.cat([dot_cross(q[m, h], r[n, h]), dot_cross(q[m, h], rotated(k0[n], phi_rot))])  # (2d,)
                gram[h] += torch.outer(f, f)
                rhs[h] += f * t
    return gram, rhs


@pytest.mark.parametrize("folded", [False, True])
def test_normal_equations_equal_the_sums_over_the_drawn_pairs(folded):
    from convert.targets.vllm.nope_fit import fit_normal_equations, sample_keys

    g = torch.Generator().manual_seed(0)
    L, H, d = 7, 3, 8
    q, r, k0 = torch.randn(L, H, d, generator=g), torch.randn(L, H, d, generator=g), torch.randn(L, d, generator=g)
    probs = torch.softmax(torch.randn(H, L, L, generator=g).masked_fill(torch.ones(L, L).triu(1).bool(), -1e9), -1)
    keys = sample_keys(probs, 5, torch.Generator().manual_seed(1))  # (H, L, 5)
    assert (keys <= torch.arange(L)[None, :, None]).all()  # causal: only keys the query attends
    inv_freq = 10.0 ** -torch.linspace(0, 2, d // 2)
    fold = ()
    if folded:  # two pairs per slot: pair 2s + 1 turns at θ_{2s}
        fold = (inv_freq.reshape(-1, 2)[:, :1].expand(-1, 2).reshape(-1), torch.randn(H, d // 2, generator=g))
    got = fit_normal_equations(q, r, k0, keys, inv_freq, *fold)
    want = _brute_force_equations(q, r, k0, keys, inv_freq, *fold)
    for g_, w_ in zip(got, want):
        assert torch.allclose(g_, w_, rtol=1e-10, atol=1e-10)


def test_sampled_keys_follow_the_attention_probabilities():
    from convert.targets.vllm.nope_fit import sample_keys

    probs = torch.tensor([[[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.1, 0.2, 0.7]]])  # (1, 3, 3)
    keys = sample_keys(probs, 20000, torch.Generator().manual_seed(0))[0]  # (3, 20000)
    for m in range(3):
        share = torch.bincount(keys[m], minlength=3).double() / keys.shape[-1]
        assert torch.allclose(share, probs[0, m].double(), atol=0.02), (m, share)


def _fit(q, r, k0, theta):
    from convert.targets.vllm.nope_fit import fit_normal_equations, fit_rotation_stand_in, sample_keys

    L, H, d = q.shape
    probs = torch.softmax(torch.randn(H, L, L, dtype=torch.float64, generator=torch.Generator().manual_seed(5)), -1)
    keys = sample_keys(probs, 8, torch.Generator().manual_seed(2))
    return fit_rotation_stand_in(*fit_normal_equations(q, r, k0, keys, torch.full((d // 2,), theta)))


def test_fit_recovers_a_stand_in_that_is_exact():
    """Where the rotation does not turn (θ = 0) the unrotated terms are exact: the fit gives (1, 0)
    and adds nothing to the rotary query; a frequency with no remainder gets (1, 0), not a
    singular solve. A remainder that is a rotation-form map C of the rotary mixture turns with
    it: the fit moves it to the rotary query exactly, (α', β') = C's, position-free (0, 0)."""
    g = torch.Generator().manual_seed(1)
    L, H, d = 12, 2, 8
    q, r = (
        torch.randn(L, H, d, dtype=torch.float64, generator=g),
        torch.randn(L, H, d, dtype=torch.float64, generator=g),
    )
    k0 = torch.randn(L, d, dtype=torch.float64, generator=g)
    r[..., [1, 1 + d // 2]] = 0.0  # frequency 1: nothing position-free
    unrotated = torch.tensor([1.0, 0.0], dtype=torch.float64)
    fit = _fit(q, r, k0, 0.0)
    assert torch.allclose(fit[:, 0], unrotated.expand_as(fit[:, 0]), atol=1e-9)
    assert fit[:, 1].abs().max() < 1e-9
    turning = _fit(q, r, k0, 0.5)
    assert not torch.allclose(turning[:, 0, 0], unrotated)  # it does fit something
    assert torch.equal(turning[:, 0, 1], unrotated.expand(H, 2))

    c, s = 0.6, -0.3  # C = [[c, s], [-s, c]]: C k0 = (c x + s y, -s x + c y) per pair
    x, y = k0[:, : d // 2], k0[:, d // 2 :]
    along = torch.cat([c * x + s * y, -s * x + c * y], dim=-1)[:, None].expand(L, H, d)  # (L, H, d)
    moved = _fit(q, along.contiguous(), k0, 0.5)
    assert moved[:, 0].abs().max() < 1e-8
    assert torch.allclose(moved[:, 1], torch.tensor([c, s], dtype=torch.float64).expand_as(moved[:, 1]), atol=1e-8)


def test_key_remainder_removes_the_rotary_mixture():
    from convert.targets.vllm.nope_fit import key_remainder

    g = torch.Generator().manual_seed(2)
    B, L, G, d = 2, 5, 3, 8
    k = torch.randn(B, L, G, d, dtype=torch.float64, generator=g)
    u = torch.nn.functional.normalize(torch.randn(d // 2, G, dtype=torch.float64, generator=g), dim=-1)  # (d/2, G)
    r = key_remainder(k, u)
    pairs, rest = k.reshape(B, L, G, 2, d // 2), r.reshape(B, L, G, 2, d // 2)
    assert torch.einsum("blgph,hg->blph", rest, u).abs().max() < 1e-12  # nothing of u_j left
    removed = pairs - rest  # = u_j (u_jᵀ k): along u_j over the groups
    along = torch.einsum("blgph,hg->blph", pairs, u)
    assert torch.allclose(removed, u.T[None, None, :, None, :] * along[:, :, None], atol=1e-12)


@pytest.mark.parametrize("fold", [1, 2])
def test_rotary_key_and_remainder_add_up_to_each_heads_key(fold):
    """At Δ = 0 nothing turns: the rotary query (its coefficients u_s[g(h)·f + i]) against the rotary
    key of each pair's slot, plus the query against the remainder, is q·k of the head's group."""
    from convert.targets.vllm.nope_fit import key_remainder, per_pair, rotary_coefficients, rotary_mixture

    g = torch.Generator().manual_seed(4)
    L, G, H, d = 5, 2, 4, 8 * fold
    k = torch.randn(1, L, G, d, dtype=torch.float64, generator=g)
    q = torch.randn(L, H, d, dtype=torch.float64, generator=g)
    u = torch.nn.functional.normalize(torch.randn(4, G * fold, dtype=torch.float64, generator=g), dim=-1)
    groups = torch.arange(H) // (H // G)
    r = key_remainder(k, u)[0]  # (L, G, d)
    assert rotary_mixture(r[None], u).abs().max() < 1e-12  # nothing of u_s left
    k0 = per_pair(rotary_mixture(k, u)[0], fold)  # (L, d)
    base = rotary_coefficients(u, groups, G).repeat(1, 2)  # (H, d): both halves of each pair
    got = (q * base * k0[:, None]).sum(-1) + (q * r[:, groups]).sum(-1)  # (L, H)
    assert torch.allclose(got, (q * k[0][:, groups]).sum(-1), atol=1e-12)


def test_attention_probabilities_are_the_modules_own():
    from transformers.masking_utils import create_causal_mask

    from convert.targets.vllm.nope_fit import attention_probabilities

    model = tiny_llama(3)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    captured = {}
    attention = model.model.layers[1].self_attn

    def keep(module, args, kwargs, output):
        captured.update(x=kwargs["hidden_states"], rotary=kwargs["position_embeddings"], probs=output[1])

    handle = attention.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    positions = torch.arange(10)[None]
    embeds = model.model.embed_tokens(ids)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=positions
    )
    with torch.no_grad():
        got = attention_probabilities(attention, captured["x"], captured["rotary"], mask)
        causal = attention_probabilities(attention, captured["x"], captured["rotary"], None)  # as sdpa leaves it
    assert torch.allclose(got, captured["probs"], atol=1e-6)
    assert torch.allclose(causal, captured["probs"], atol=1e-6)


@pytest.mark.slow
def test_the_fitted_stand_in_beats_unrotated_terms_on_smollm2(smollm2, tmp_path):
    """SmolLM2 (G = 3) calibrated on one Austen novel, perplexity on another: the fitted stand-in
    for the dropped rotations loses less than keeping the position-free terms unrotated."""
    import json

    import realdata
    from transformers import AutoModelForCausalLM

    from convert.compress.calibrate import calibrate
    from convert.io import open_checkpoint
    from convert.targets.vllm.calibration import rotation_fit_observer
    from convert.targets.vllm.export import resolve_vllm_spec
    from convert.text import text_token_ids

    config = json.loads((smollm2 / "config.json").read_text())
    calib_path, eval_path = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib_path.write_text(realdata.austen_text("prideprejudice"), encoding="utf-8")
    eval_path.write_text(realdata.austen_text("persuasion"), encoding="utf-8")
    calib = text_token_ids(calib_path, smollm2, config["vocab_size"], 2048)
    ids = text_token_ids(eval_path, smollm2, config["vocab_size"], 512)
    with open_checkpoint(smollm2) as checkpoint:
        state = {name: checkpoint.get(name) for name in checkpoint.keys()}
        _, source, spec = resolve_vllm_spec(state, config)
        observe = rotation_fit_observer(source, spec, config)
        stats = calibrate(checkpoint, config, calib, spec.n_layers, observe=observe)
    assert all(s.rotation_fit.shape == (9, 2, 32, 2) for s in stats)

    def perplexity(model) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        return float(logp.gather(-1, ids[0, 1:, None]).mean().neg().exp())

    original = perplexity(AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval())
    ratios = {}
    for stand_in in ("fit", "nope"):
        deepseek, _, _, export = exported_model_from(state, config, stats, stand_in=stand_in)
        assert export["position_free_terms"] == stand_in
        ratios[stand_in] = perplexity(deepseek) / original
    assert 1.0 < ratios["fit"] < ratios["nope"], ratios


def test_shrinkage_keeps_a_compressed_latent_on_directions_the_calibration_missed():
    """--shrinkage reaches the vllm export's compressed latent: inputs the calibration never excited
    (half the hidden dims) are reconstructed better with it, the calibrated ones about as well."""
    from types import SimpleNamespace

    from convert.targets.vllm.latent import LatentFit, latent_factor

    gen = torch.Generator().manual_seed(0)
    hidden, seen = 48, 24
    spec = SimpleNamespace(n_kv_heads=2, head_dim=64)  # 192 content dims, more than the hidden size
    remainder, value = (torch.randn(128, hidden, dtype=torch.float64, generator=gen) for _ in range(2))
    x = torch.randn(512, hidden, dtype=torch.float64, generator=gen)
    x[:, seen:] = 0  # the calibration excites the first 24 input dims only
    eye = torch.eye(128, dtype=torch.float64)
    stats = SimpleNamespace(moment=x.T @ x / 512, key_fisher=eye, value_fisher=eye)
    content = torch.cat([remainder, value])  # (256, 48)

    def errors(shrinkage: float) -> tuple[float, float]:
        factor, compressed = latent_factor(remainder, value, spec, LatentFit(32, stats, None, shrinkage))
        assert compressed
        residual = content - factor.up @ factor.down  # (256, 48)
        return float(residual[:, :seen].norm()), float(residual[:, seen:].norm())

    (seen_plain, missed_plain), (seen_shrunk, missed_shrunk) = errors(0.0), errors(0.1)
    assert missed_shrunk < 0.8 * missed_plain
    assert seen_shrunk < 0.1 * float(content[:, :seen].norm()), (seen_plain, seen_shrunk)


def test_a_frozen_export_takes_vllms_norms_and_a_trained_one_keeps_the_norm_rows_at_zero():
    """`match_vllm_norms` on a model without gradients (torch takes no hook there) is no error; on a
    trainable one a training step leaves the latent norm's rows (`NORM_ROWS`) at zero."""
    from convert.targets.vllm.geometry import KV_LORA_RANK, LATENT_DIMS

    deepseek, _, _, _ = exported_model(tiny_llama(3), identity_stats())
    match_vllm_norms(deepseek.requires_grad_(False))  # frozen: nothing to hold
    trained, _, _, _ = exported_model(tiny_llama(3), identity_stats())  # trainable: held by its hook
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    trained(ids, labels=ids).loss.backward()
    grads = [layer.self_attn.kv_a_proj_with_mqa.weight.grad for layer in trained.model.layers]
    assert all(g is not None and g[:LATENT_DIMS].abs().sum() > 0 for g in grads)
    assert not any(g[LATENT_DIMS:KV_LORA_RANK].any() for g in grads)
