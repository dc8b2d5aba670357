"""The `transformers` target: an exact DeepseekV3ForCausalLM that stock transformers loads.

Each case exports a tiny random source model (transformers' own config classes, random
non-zero attention biases), writes it as a plain model directory (model.safetensors +
config.json) and loads it in a subprocess that never imports `convert`, with
`AutoModelForCausalLM.from_pretrained` and no custom code. Logits on the same ids must
match the source's (relative Frobenius error) and 16 greedy tokens must be identical.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from convert.errors import ConvertError
from convert.rope.frequencies import longrope_factors
from convert.targets.deepseek import interleave_rows, square_width, to_deepseek_v3

FLOAT32_TOL = 1e-5
# transformers' DeepseekV3RMSNorm computes in float32 even for float64 inputs, so the value
# latent is rounded to float32 inside kv_a_layernorm: float64 is float32-accurate, no better.
FLOAT64_TOL = 1e-6
GREEDY_TOKENS = 16

# One subprocess loads every exported directory: stock transformers only.
LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
jobs, out = json.loads(sys.argv[1]), {}
for job in jobs:
    model, info = AutoModelForCausalLM.from_pretrained(
        job["dir"], attn_implementation=job["attn"], dtype=getattr(torch, job["dtype"]), output_loading_info=True
    )
    unused = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    assert not unused, f"{job['name']}: {unused}"
    model.eval()
    ids = torch.load(job["ids"])
    with torch.no_grad():  # as source_outputs in the test module
        prefill = model(ids[:, :-1], use_cache=True)
        new = job["new_tokens"]
        greedy = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=prefill.past_key_values,
            max_new_tokens=new, min_new_tokens=new, do_sample=False,
        )
    logits = prefill.logits
    out[job["name"]] = {"class": f"{type(model).__module__}.{type(model).__name__}", "logits": logits, "greedy": greedy}
loaded = sorted(m for m in sys.modules if m == "convert" or m.startswith("convert."))
assert not loaded, f"the loader imported {loaded}"
torch.save(out, sys.argv[2])
"""

DEEPSEEK_CLASS = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3ForCausalLM"

TINY = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=None),
    "qwen2": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=16),
}
ROPE = {  # max_position_embeddings is 256
    "llama3": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=3.0),
    "longrope": dict(  # short factors up to 128 positions, long ones beyond
        rope_type="longrope",
        factor=2.0,
        original_max_position_embeddings=128,
        short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.3 * i for i in range(8)],
    ),
}
# name: (model_type, overrides, dtype, attention, sequence length)
CASES = {
    "llama_gqa_4_2": ("llama", {}, "float32", "eager", 64),
    "llama_gqa_6_3_d8": (
        "llama",
        dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
        "float32",
        "eager",
        64,
    ),
    "llama_gqa_8_2_d32": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32),
        "float32",
        "eager",
        64,
    ),
    "llama_mha": ("llama", dict(num_key_value_heads=4), "float32", "eager", 64),
    "llama_mqa": ("llama", dict(num_key_value_heads=1), "float32", "eager", 64),
    "llama_attention_bias": ("llama", dict(attention_bias=True), "float32", "eager", 64),
    "llama_tied": ("llama", dict(tie_word_embeddings=True), "float32", "eager", 64),
    "llama_sdpa": ("llama", {}, "float32", "sdpa", 64),
    "mistral": ("mistral", {}, "float32", "eager", 64),
    "qwen2": ("qwen2", {}, "float32", "eager", 64),
    "llama_rope_llama3": ("llama", dict(rope=ROPE["llama3"]), "float32", "eager", 200),
    "llama_rope_yarn": ("llama", dict(rope=ROPE["yarn"]), "float32", "eager", 200),
    "llama_rope_linear": ("llama", dict(rope=ROPE["linear"]), "float32", "eager", 200),
    "llama_rope_longrope_short": ("llama", dict(rope=ROPE["longrope"]), "float32", "eager", 100),
    "llama_rope_longrope_long": ("llama", dict(rope=ROPE["longrope"]), "float32", "eager", 200),
    "qwen2_rope_yarn": ("qwen2", dict(rope=ROPE["yarn"]), "float32", "eager", 200),
    "llama_float64": ("llama", {}, "float64", "sdpa", 64),
    "qwen2_float64": ("qwen2", {}, "float64", "sdpa", 64),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a small shared machine, OpenMP threads waiting on each other cost
    5-10x the work itself (measured: SmolLM2 prefill of 255 tokens 1.1 s on one thread, 11 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def source_model(model_type: str, dtype=torch.float32, seed: int = 0, rope=None, **overrides):
    """A tiny transformers causal LM with random non-zero attention biases (as conftest.hf_model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.15,  # attention far from uniform
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    fields |= TINY[model_type] | overrides
    if rope is not None:
        fields["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=dtype)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." in name and name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(dtype))
    return model.eval()


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact.double()).norm() / exact.double().norm())


def write_model_dir(state_dict: dict, config: dict, directory) -> None:
    """What save_pretrained writes: model.safetensors and config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, directory / "model.safetensors", {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def load_in_stock_transformers(jobs: list[dict], tmp_path) -> dict:
    """Run LOADER in a fresh interpreter on the exported directories."""
    out = tmp_path / "loaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(jobs), str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@torch.no_grad()
def source_outputs(model, ids: torch.Tensor, new_tokens: int):
    """Logits on ids[:, :-1] and the greedy continuation of ids (generate, reusing that prefill's cache)."""
    prefill = model(ids[:, :-1], use_cache=True)
    greedy = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=prefill.past_key_values,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    return prefill.logits, greedy


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case exported, written and loaded by stock transformers in one subprocess.

    Returns {case: (source logits, source greedy, loaded result)}; an export that raised
    is kept as its exception, so only its own test fails.
    """
    root = tmp_path_factory.mktemp("deepseek")
    jobs, sources, results = [], {}, {}
    for name, (model_type, overrides, dtype, attention, length) in CASES.items():
        try:
            model = source_model(model_type, getattr(torch, dtype), **overrides)
            model.config._attn_implementation = attention
            state, config = to_deepseek_v3(model.state_dict(), model.config)
        except Exception as error:  # reported by the case's own test
            results[name] = error
            continue
        write_model_dir(state, config, root / name)
        ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(7))
        torch.save(ids, root / f"{name}.ids.pt")
        sources[name] = source_outputs(model, ids, GREEDY_TOKENS)
        jobs.append(
            dict(name=name, dir=str(root / name), ids=str(root / f"{name}.ids.pt"), dtype=dtype, attn=attention)
            | {"new_tokens": GREEDY_TOKENS}
        )
    loaded = load_in_stock_transformers(jobs, root) if jobs else {}
    for name in sources:
        results[name] = (*sources[name], loaded[name])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_exact_in_stock_transformers(case, exported):
    result = exported[case]
    if isinstance(result, Exception):
        raise result
    logits, greedy, loaded = result
    assert loaded["class"] == DEEPSEEK_CLASS
    tol = FLOAT64_TOL if CASES[case][2] == "float64" else FLOAT32_TOL
    err = rel_err(loaded["logits"], logits)
    assert err <= tol, f"{case}: logits relative error {err:.3g} > {tol}"
    assert torch.equal(loaded["greedy"], greedy), f"{case}: greedy tokens differ"


# ------------------------------------------------------------------ the exported checkpoint


def test_config_is_plain_deepseek_v3():
    model = source_model("qwen2")
    state, config = to_deepseek_v3(model.state_dict(), model.config)
    H, G, d = 6, 3, 16
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "auto_map" not in config
    assert config["qk_nope_head_dim"] == 0 and config["qk_rope_head_dim"] == G * d and config["v_head_dim"] == d
    assert config["num_key_value_heads"] == H and config["rope_interleave"] and config["attention_bias"]
    assert math.isqrt(config["kv_lora_rank"]) ** 2 == config["kv_lora_rank"] >= G * d + 1
    assert math.isqrt(config["q_lora_rank"]) ** 2 == config["q_lora_rank"] >= H * d + 1  # Qwen2's q bias
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["rope_theta"] == 1.0 and rope["attention_factor"] == 1.0
    theta = [10000.0 ** (2 * j / d) for j in range(d // 2)]
    assert rope["short_factor"] == rope["long_factor"] and len(rope["short_factor"]) == G * d // 2
    assert torch.allclose(torch.tensor(rope["short_factor"]), torch.tensor(theta * G), rtol=1e-6)
    assert "self_attn.q_proj.weight" not in " ".join(state) and "model.layers.1.self_attn.q_a_proj.bias" in state


def test_plain_llama_has_no_q_lora_and_tied_head_is_written():
    model = source_model("llama", tie_word_embeddings=True)
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.state_dict()
    state, config = to_deepseek_v3(model.state_dict(), model.config)
    assert config["q_lora_rank"] is None and "model.layers.0.self_attn.q_proj.weight" in state
    assert config["tie_word_embeddings"] is False
    assert torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()


def test_config_json_of_older_transformers():
    """A config.json written by transformers 4 (rope_theta + rope_scaling) exports the same."""
    model = source_model("llama", rope=ROPE["llama3"])
    new_style = model.config.to_dict()
    old_style = {k: v for k, v in new_style.items() if k != "rope_parameters"}
    rope = dict(new_style["rope_parameters"])
    old_style["rope_theta"] = rope.pop("rope_theta")
    old_style["rope_scaling"] = rope
    state_new, config_new = to_deepseek_v3(model.state_dict(), new_style)
    state_old, config_old = to_deepseek_v3(model.state_dict(), old_style)
    assert config_old["rope_parameters"] == config_new["rope_parameters"]
    assert state_old.keys() == state_new.keys() and all(torch.equal(state_old[k], state_new[k]) for k in state_new)


def test_dtype_argument():
    model = source_model("qwen2")
    state, config = to_deepseek_v3(model.state_dict(), model.config, dtype="bfloat16")
    assert config["dtype"] == "bfloat16" and {t.dtype for t in state.values()} == {torch.bfloat16}
    latent = state["model.layers.0.self_attn.kv_a_proj_with_mqa.bias"][config["kv_lora_rank"] - 1]
    assert float(latent) == math.isqrt(config["kv_lora_rank"]) * 2.0**20  # M = √n·2^k, k = 20 in bf16


def test_bfloat16_export_tracks_the_source():
    """bf16 is not exact (bf16 rounds everywhere) but must be as close as bf16 allows."""
    model = source_model("qwen2")
    state, config = to_deepseek_v3(model.state_dict(), model.config, dtype=torch.bfloat16)
    deepseek = _in_process(state, config, torch.bfloat16)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = rel_err(deepseek(ids).logits, model(ids).logits)
    assert err < 2e-2, err


# ------------------------------------------------------------------ the math pieces


def test_interleave_rows_is_transformers_rotation():
    """Rotating the permuted rows the DeepSeek way = permuting the rows rotated the Llama way."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    G, d, L = 3, 8, 5
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, G, L, d, generator=gen, dtype=torch.float64)  # source: G heads of d
    inv = torch.rand(d // 2, generator=gen, dtype=torch.float64)
    angles = torch.arange(L, dtype=torch.float64)[:, None] * inv  # (L, d/2)
    emb = torch.cat([angles, angles], -1)[None]
    k_rot, _ = apply_rotary_pos_emb(k, k, emb.cos(), emb.sin())
    flat = k.transpose(1, 2).reshape(1, 1, L, G * d)[..., interleave_rows(G, d)]  # DeepSeek k_pe rows
    angles_all = angles.repeat(1, G)  # pair p = g·d/2 + j has frequency j
    emb_all = torch.cat([angles_all, angles_all], -1)[None]
    got, _ = apply_rotary_pos_emb_interleave(flat, flat, emb_all.cos(), emb_all.sin())
    # transformers' interleaved rotation returns [even outputs | odd outputs]; rebuild the source layout
    half = G * d // 2
    evens, odds = got[..., :half].reshape(1, L, G, d // 2), got[..., half:].reshape(1, L, G, d // 2)
    assert torch.allclose(torch.cat([evens, odds], -1).transpose(1, 2)[0], k_rot[0], atol=1e-12)


def test_longrope_factors_reproduce_default_frequencies_exactly():
    for base, d in ((10000.0, 64), (1e5, 64), (5e5, 128), (1e6, 48)):
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        factors, ulps = longrope_factors(inv)
        assert torch.equal(1.0 / factors, inv) and float(ulps.max()) == 0.0


def test_latent_norm_is_neutralized_bitwise():
    """transformers' DeepseekV3RMSNorm (eps fixed at 1e-6) passes the value dims through unchanged."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from convert.targets.deepseek.tensors import neutralized_latent as _neutralized_latent

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(20, 8, generator=gen), torch.randn(20, generator=gen)
    n = square_width(21, torch.float32)
    assert n == 25
    proj_w, proj_b, norm_w = (t.float() for t in _neutralized_latent(w, b, n, 40))
    x = 3 * torch.randn(7, 8, generator=gen)
    norm = DeepseekV3RMSNorm(n)  # eps 1e-6, as DeepseekV3Attention builds it
    norm.weight.data = norm_w
    latent = torch.nn.functional.linear(x, proj_w, proj_b)
    assert torch.equal(norm(latent)[:, :20], latent[:, :20])


# ------------------------------------------------------------------ sensitivity: the checks can fail


def _in_process(state, config, dtype):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = {k: v for k, v in config.items() if k != "convert_export"}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).to(dtype)
    model.load_state_dict(state, strict=True)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("damage", ["rotate_half_order", "frequency_order", "drop_q_bias", "drop_k_bias", "scale"])
def test_comparison_detects_a_broken_export(damage):
    """The same comparison fails on deliberately broken exports: it is not vacuous."""
    model = source_model("qwen2")
    model.config._attn_implementation = "eager"
    state, config = to_deepseek_v3(model.state_dict(), model.config)
    attn = "model.layers.0.self_attn."
    n, R = config["kv_lora_rank"], config["qk_rope_head_dim"]
    if damage == "rotate_half_order":  # keys left in rotate_half order: wrong pairs rotate together
        keys = interleave_rows(3, 16)
        w = state[attn + "kv_a_proj_with_mqa.weight"]
        w[n:][keys] = w[n:].clone()
    elif damage == "frequency_order":  # frequencies per group reversed
        rope = config["rope_parameters"]
        rope["short_factor"] = rope["long_factor"] = rope["short_factor"][::-1]
    elif damage == "drop_q_bias":
        state[attn + "q_a_proj.bias"][: 6 * 16] = 0
    elif damage == "drop_k_bias":
        state[attn + "kv_a_proj_with_mqa.bias"][n : n + R] = 0
    elif damage == "scale":  # DeepSeek's 1/sqrt(G·d) softmax scale not compensated
        state[attn + "q_b_proj.weight"] /= math.sqrt(3)
    deepseek = _in_process(state, config, torch.float32)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        err = rel_err(deepseek(ids).logits, model(ids).logits)
    assert err > 100 * FLOAT32_TOL, f"{damage}: error {err:.3g} not detected"


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "model_type, overrides, needle",
    [
        ("mistral", dict(sliding_window=5), "sliding_window=5"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding_window=16"),
        ("llama", dict(rope=dict(rope_type="dynamic", factor=2.0)), "rope_type='dynamic'"),
        ("llama", dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_refuses_what_deepseek_cannot_hold(model_type, overrides, needle):
    model = source_model(model_type, **overrides)
    with pytest.raises(ConvertError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        to_deepseek_v3(model.state_dict(), model.config)


def test_refuses_float16_and_unknown_tensors():
    model = source_model("llama")
    with pytest.raises(ConvertError, match="float16"):
        to_deepseek_v3(model.state_dict(), model.config, dtype=torch.float16)
    state = dict(model.state_dict())
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(96)
    with pytest.raises(ConvertError, match="mlp.gate_proj.bias"):
        to_deepseek_v3(state, model.config)


def test_window_not_shorter_than_context_is_accepted():
    model = source_model("mistral", sliding_window=256)  # = max_position_embeddings: never matters
    _, config = to_deepseek_v3(model.state_dict(), model.config)
    assert config["max_position_embeddings"] == 256


# ------------------------------------------------------------------ the real model


@pytest.mark.slow
@pytest.mark.realdata
def test_smollm2_in_stock_transformers(tmp_path):
    """SmolLM2-135M (GQA 9:3, d=64, tied embeddings): logits on Austen prose and greedy text."""
    realdata = pytest.importorskip("realdata")  # fixtures/ is on sys.path (conftest)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (realdata.cache_dir() / "smollm2-135m-instruct-f32" / "model.safetensors").is_file():
        pytest.skip("SmolLM2 is not built: run python fixtures/realdata.py")
    root = realdata.smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(root)
    ids = torch.tensor(tokenizer(realdata.austen_text("emma"))["input_ids"][:256])[None]
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, attn_implementation="eager").eval()
    state, config = to_deepseek_v3(model.state_dict(), model.config)
    write_model_dir(state, config, tmp_path / "smollm2-deepseek")
    del state
    torch.save(ids, tmp_path / "ids.pt")
    logits, greedy = source_outputs(model, ids, GREEDY_TOKENS)
    del model
    job = dict(name="smollm2", dir=str(tmp_path / "smollm2-deepseek"), ids=str(tmp_path / "ids.pt"))
    loaded = load_in_stock_transformers(
        [job | dict(dtype="float32", attn="eager", new_tokens=GREEDY_TOKENS)], tmp_path
    )["smollm2"]
    assert loaded["class"] == DEEPSEEK_CLASS
    err = rel_err(loaded["logits"], logits)
    assert err <= FLOAT32_TOL, f"SmolLM2 logits relative error {err:.3g}"
    assert torch.equal(loaded["greedy"], greedy), (tokenizer.decode(loaded["greedy"][0]), tokenizer.decode(greedy[0]))
