"""The `llamacpp` target: one deepseek2 GGUF, written and read back (transformers' DeepseekV3 on its
tensors, the model llama.cpp computes), its refusals, and the real engine (scripts/llamacpp_env.sh)
when it is built: llama.cpp's prompt log-probs and greedy tokens against ours on the same file."""

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import VOCAB, tiny_llama

import convert
from convert.errors import ConvertError
from convert.targets.llamacpp import load
from convert.targets.llamacpp.engine import engine_python
from convert.targets.llamacpp.gguf_file import read_gguf
from convert.verify import verify_paths

from conftest import PROSE

ENGINE = engine_python()
BENCH = Path(__file__).resolve().parents[2] / "bench"  # llamacpp_run.py: how the bench sets llama.cpp up
needs_engine = pytest.mark.skipif(ENGINE is None, reason="llama.cpp is not built: run scripts/llamacpp_env.sh")


def converted(tmp_path, model, **options):
    model.save_pretrained(tmp_path / "src")
    return convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="llamacpp", progress=False, **options)


def ids(length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_one_kv_head_is_exact_and_the_file_is_deepseek2(tmp_path):
    model = tiny_llama(1)
    result = converted(tmp_path, model)
    assert result.passed and result.report["target"]["exact"]
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    keys = {f.name: f.contents() for f in reader.fields.values()}
    assert keys["general.architecture"] == "deepseek2"
    assert keys["deepseek2.attention.kv_lora_rank"] == 64 and keys["deepseek2.rope.dimension_count"] == 64
    assert keys["deepseek2.attention.q_lora_rank"] == 0 and keys["deepseek2.leading_dense_block_count"] == 2
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # ggml order
    assert shapes["blk.0.attn_kv_a_mqa.weight"] == (192, 64 + 64)
    assert shapes["blk.0.attn_k_b.weight"] == (64, 64, 6) and shapes["blk.0.attn_v_b.weight"] == (64, 64, 6)
    with torch.no_grad():
        want, got = model(ids()).logits, load(tmp_path / "out", "cpu", torch.float32)(ids()).logits
    assert (got - want).abs().max() < 1e-3


@pytest.mark.slow
def test_head_dim_128_keeps_every_frequency_in_a_rotary_key_as_wide(tmp_path):
    """deepseek2 reads its rotary width from the file: at head_dim 128 the key is 128 wide, each source pair
    at its own frequency, so one key/value head is exact (vLLM's fixed 64 dims turn two pairs a slot, one at
    its neighbour's frequency: lossy there, refused without a perplexity bound)."""
    model = tiny_llama(1, head_dim=128)
    result = converted(tmp_path, model)
    assert result.passed and result.report["target"]["exact"]
    keys = {f.name: f.contents() for f in gguf.GGUFReader(str(tmp_path / "out" / "model.gguf")).fields.values()}
    assert keys["deepseek2.rope.dimension_count"] == 128 and keys["deepseek2.attention.kv_lora_rank"] == 128
    with torch.no_grad():
        want, got = model(ids()).logits, load(tmp_path / "out", "cpu", torch.float32)(ids()).logits
    assert (got - want).abs().max() < 1e-3
    model.save_pretrained(tmp_path / "src128")
    with pytest.raises(ConvertError, match="64-dim rotary key"):
        convert.gqa2mla(tmp_path / "src128", tmp_path / "vllm", target="vllm", progress=False)


@pytest.mark.slow
def test_the_gguf_is_the_only_weights_file_and_verify_reads_it(tmp_path):
    """No empty model.safetensors beside model.gguf (a loader would find it and build a model of no
    weights); `convert verify` checks the directory from its GGUF."""
    converted(tmp_path, tiny_llama(1))
    out = tmp_path / "out"
    assert not list(out.glob("*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    report = verify_paths(tmp_path / "src", out, progress=False)
    assert report["decision"]["verdict"] == "PASS", report["decision"]
    assert list(report["inputs"]["converted"]["files"]) == ["model.gguf"]


@pytest.mark.slow
def test_three_kv_heads_are_lossy_and_judged_by_perplexity(tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    with pytest.raises(ConvertError, match="lossy.*text=FILE.*max_ppl_ratio=R"):
        converted(tmp_path, tiny_llama(3), calib=ids(64, 2))
    result = converted(tmp_path, tiny_llama(3), calib=ids(64, 2), text=text, max_ppl_ratio=1.5, tokens=64)
    target = result.report["target"]
    assert not target["exact"] and "LOSSY" in target["note"]
    assert target["cache_values_per_token_per_layer"] == 192 + 64  # the latent capped by the hidden size
    assert target["perplexity_ratio"] < 1.5


@pytest.mark.slow
def test_kv_cache_ratio_compresses_the_latent_beside_the_rotary_key(tmp_path):
    """--kv-cache-ratio 0.5 of three heads' 384 values: 192 cached, 64 of them the rotary key, so a
    128-dim latent (of the 192 the hidden size allows), fitted on the calibration text; the file holds
    that rank, the report says so, and it is judged as a compression is."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    options = dict(calib=ids(64, 2), text=text, max_ppl_ratio=100.0, tokens=64)
    full = converted(tmp_path, tiny_llama(3), **options)
    half = convert.gqa2mla(tmp_path / "src", tmp_path / "half", target="llamacpp", kv_cache_ratio=0.5, **options,
                           progress=False)  # fmt: skip
    reader = gguf.GGUFReader(str(tmp_path / "half" / "model.gguf"))
    assert int(reader.fields["deepseek2.attention.kv_lora_rank"].contents()) == 128
    export = half.config["convert_export"]
    assert export["latent_compressed"] and export["latent_dims_used"] == 128
    target = half.report["target"]
    assert target["cache_values_per_token_per_layer"] == 192 and "COMPRESSED" in target["note"]
    assert full.report["target"]["cache_values_per_token_per_layer"] == 192 + 64
    # less room, more loss: the compressed file is further from the original than the full-width one
    error = lambda result: result.report["end_to_end"]["logits_rel_error"]
    assert error(half) > error(full)
    with pytest.raises(ConvertError, match="method"):  # the latent's only size knob: no other mla flag
        convert.gqa2mla(tmp_path / "src", tmp_path / "x", target="llamacpp", kv_cache_ratio=0.5, method="svd")


@pytest.mark.slow
def test_latent_multiple_pads_the_latent_with_zeros_or_rounds_a_compressed_rank_up(tmp_path):
    """--latent-multiple 128 (llama.cpp's CPU attention is several times as fast at such widths): the
    three-head export's 192 latent dims written as 256, the 64 more zeros, the model computed the same;
    with --kv-cache-ratio 0.25 the 32 dims it leaves are rounded up to 128 of fitted latent."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    options = dict(calib=ids(64, 2), text=text, max_ppl_ratio=100.0, tokens=64)
    converted(tmp_path, tiny_llama(3), **options)
    padded = convert.gqa2mla(tmp_path / "src", tmp_path / "padded", target="llamacpp", latent_multiple=128,
                             progress=False, **options)  # fmt: skip
    tensors, keys = read_gguf(tmp_path / "padded" / "model.gguf")
    assert keys["deepseek2.attention.kv_lora_rank"] == 256
    assert padded.report["target"]["cache_values_per_token_per_layer"] == 256 + 64
    assert "zero-padded from 192 to 256" in padded.report["target"]["note"]
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][192:256].abs().max() == 0
    with torch.no_grad():
        want = load(tmp_path / "out", "cpu", torch.float32)(ids()).logits
        got = load(tmp_path / "padded", "cpu", torch.float32)(ids()).logits
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    quarter = convert.gqa2mla(tmp_path / "src", tmp_path / "quarter", target="llamacpp", latent_multiple=128,
                              kv_cache_ratio=0.25, progress=False, **options)  # fmt: skip
    export = quarter.config["convert_export"]
    assert export["latent_compressed"] and export["latent_dims_used"] == 128 and not export["latent_padded_to"]
    assert quarter.report["target"]["cache_values_per_token_per_layer"] == 128 + 64
    with pytest.raises(ConvertError, match="latent_multiple.*only for target='llamacpp'"):
        convert.gqa2mla(tmp_path / "src", tmp_path / "x", target="vllm", latent_multiple=128)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_stay_tied_in_the_file(tmp_path, tied):
    """A tied model's file has no output.weight (llama.cpp reads token_embd; SmolLM2: 56 MB less in
    F16), its final norm carrying the scales the embedding took; an untied one keeps its head."""
    model = tiny_llama(1).to(torch.float16)
    if not tied:  # an untied head: its own copy of the embedding
        model.config.tie_word_embeddings = False
        other = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.02
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() + other.half())
    converted(tmp_path, model)
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "out" / "model.gguf")).tensors}
    assert ("output.weight" in names) is not tied
    with torch.no_grad():
        want = model.float()(ids()).logits
        got = load(tmp_path / "out", "cpu", torch.float32)(ids()).logits
    assert (got - want).abs().max() < 2e-2


@pytest.mark.slow
def test_a_bfloat16_checkpoint_is_written_bf16_and_read_back_whole(tmp_path):
    """Users' checkpoints are bfloat16: the file's BF16 matrices have their full shapes (gguf reads a
    byte shape for raw data; an element shape halved every row once) and verify exactly."""
    result = converted(tmp_path, tiny_llama(1).to(torch.bfloat16))
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type.name == "BF16" and tuple(int(n) for n in embd.shape) == (192, VOCAB)
    assert result.config["convert_export"]["tensor_type"] == "bfloat16"
    assert result.report["verdict"] == "PASS"


@pytest.mark.slow
def test_float16_file_rescales_and_stays_close(tmp_path):
    model = tiny_llama(1).to(torch.float16)
    result = converted(tmp_path, model)
    export = result.config["convert_export"]
    assert export["tensor_type"] == "float16" and export["residual_scale_log2"] < 0
    tensors, _ = read_gguf(tmp_path / "out" / "model.gguf")
    assert all(torch.isfinite(t).all() for t in tensors.values())
    with torch.no_grad():
        want = tiny_llama(1)(ids()).logits
        got = load(tmp_path / "out", "cpu", torch.float32)(ids()).logits
    assert (got - want).abs().max() < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type, ggml", [("F32", "F32"), ("F16", "F16"), ("bf16", "BF16")])
def test_gguf_type_sets_the_files_tensor_type(tmp_path, gguf_type, ggml):
    """--gguf-type over the checkpoint's dtype (a float32 tiny Llama here), any case, as llama.cpp's
    tools take it; matrices in that type, norms float32 as llama.cpp's converter writes them. Coarser
    than the checkpoint, every matrix is rounded: lossy, judged by perplexity (a bound is asked for)."""
    narrowed = ggml != "F32"
    if narrowed:
        with pytest.raises(ConvertError, match="rounds every matrix.*max_ppl_ratio"):
            converted(tmp_path, tiny_llama(1), gguf_type=gguf_type)
    judged = {"max_ppl_ratio": 1.01, "tokens": 64} if narrowed else {}
    result = converted(tmp_path, tiny_llama(1), gguf_type=gguf_type, **judged)
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_k_b.weight"] == ggml and types["blk.0.attn_norm.weight"] == "F32"
    assert result.report["verdict"] == "PASS" and result.config["convert_export"]["exact"] is not narrowed
    assert ("every matrix rounded" in result.report["target"]["note"]) is narrowed


def test_quantized_types_need_the_engine_and_a_perplexity_bound(tmp_path, monkeypatch):
    """Q8_0 / Q4_K_M are llama.cpp's quantizer's: without the engine, exit 3 naming the script that
    builds it; with it, lossy, so --max-ppl-ratio (or --no-verify) is asked for first; refused for
    another target and for a model in memory."""
    tiny_llama(1).save_pretrained(tmp_path / "src")
    monkeypatch.setenv("CONVERT_LLAMACPP_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(convert.errors.EnvironmentFailure, match="llamacpp_env.sh") as failure:
        convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="llamacpp", gguf_type="Q8_0", progress=False)
    assert failure.value.exit_code == 3 and not (tmp_path / "out").exists()
    with pytest.raises(ConvertError, match="gguf_type.*only for target='llamacpp'"):
        convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="vllm", gguf_type="F16")
    with pytest.raises(ConvertError, match="gguf_type"):
        convert.to_mla(tiny_llama(1), target="llamacpp", gguf_type="F16")
    with pytest.raises(ConvertError, match="gguf_type='Q5_K' is not one of"):
        convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="llamacpp", gguf_type="q5_k")


@pytest.mark.slow
@needs_engine
def test_q8_0_by_llama_cpps_quantizer_is_judged_by_perplexity(tmp_path):
    """--gguf-type Q8_0: llama.cpp's own quantizer writes the file (the F16 it read gone), the matrices
    Q8_0; read back, it stays close to the original and is reported lossy by quantization only."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    with pytest.raises(ConvertError, match="lossy.*max_ppl_ratio"):
        converted(tmp_path, tiny_llama(1), gguf_type="Q8_0")
    result = convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="llamacpp", gguf_type="Q8_0", text=text,
                             max_ppl_ratio=1.05, tokens=64, progress=False)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "out").glob("model.gguf*")) == ["model.gguf"]
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.attn_k_b.weight"] == "Q8_0"
    export = result.config["convert_export"]
    assert export["tensor_type"] == "Q8_0" and not export["exact"] and result.config["dtype"] == "float16"
    note = result.report["target"]["note"]
    assert "quantized to Q8_0" in note and "rotary key shared" not in note
    assert result.report["verdict"] == "PASS"


@pytest.mark.slow
@needs_engine
def test_q4_k_m_keeps_the_latents_tensors_at_q8_0(tmp_path):
    """--gguf-type Q4_K_M: llama.cpp's mix for the rest, the latent's three tensors Q8_0 (its mix has no
    rule for them, and Q4 there cost SmolLM2's 50% file most of its extra loss: QUANT_OVERRIDES)."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    tiny_llama(1).save_pretrained(tmp_path / "src")
    result = convert.gqa2mla(tmp_path / "src", tmp_path / "out", target="llamacpp", gguf_type="Q4_K_M", text=text,
                             max_ppl_ratio=1.5, tokens=64, progress=False)  # fmt: skip
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "out" / "model.gguf")).tensors}
    for layer in (0, 1):
        for name in ("attn_kv_a_mqa", "attn_k_b", "attn_v_b"):
            assert types[f"blk.{layer}.{name}.weight"] == "Q8_0", name
        assert types[f"blk.{layer}.attn_q.weight"] not in ("Q8_0", "F16", "F32")  # the mix's 4-5 bits
    assert "(the latent's tensors Q8_0)" in result.report["target"]["note"]


@pytest.mark.slow
@needs_engine
def test_the_quantizer_takes_per_tensor_types_as_llama_quantize_does(tmp_path):
    """`quantize(..., overrides)`: the tensors a pattern names get its type (llama-quantize's
    --tensor-type, `tt_overrides`), the others the mix's; the same file without them differs."""
    from convert.targets.llamacpp import quantize

    converted(tmp_path, tiny_llama(1).to(torch.float16))
    types = {}
    for name, overrides in (("plain", ()), ("kept", [(r"blk\.1\.attn_v_b", "F16"), (r"attn_kv_a_mqa", "F16")])):
        quantize(tmp_path / "out" / "model.gguf", tmp_path / f"{name}.gguf", "Q8_0", overrides)
        types[name] = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / f"{name}.gguf")).tensors}
    assert types["kept"]["blk.1.attn_v_b.weight"] == "F16" and types["kept"]["blk.0.attn_v_b.weight"] == "Q8_0"
    assert types["plain"]["blk.1.attn_v_b.weight"] == "Q8_0" == types["plain"]["blk.0.attn_kv_a_mqa.weight"]
    assert types["kept"]["blk.0.attn_kv_a_mqa.weight"] == "F16" and types["kept"]["blk.0.attn_q.weight"] == "Q8_0"


@pytest.mark.parametrize(
    "make, options, match",
    [
        (lambda: tiny_llama(1, hidden_act="gelu"), {}, "SwiGLU"),
        (
            lambda: tiny_llama(1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            {},
            "linear",
        ),
        (lambda: tiny_llama(1), {"kv_cache_ratio": 0.5}, "kv.cache.ratio"),
        (lambda: tiny_llama(1), {"latent_multiple": 96}, "latent.multiple.96.*divisor of 512"),
        (lambda: tiny_llama(1), {"latent_multiple": 0}, "latent.multiple.0 must be a positive"),
    ],
)
def test_refusals(tmp_path, make, options, match):
    with pytest.raises(ConvertError, match=match):
        converted(tmp_path, make(), **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_tampered_file_fails_verification(tmp_path):
    converted(tmp_path, tiny_llama(1))
    path = tmp_path / "out" / "model.gguf"
    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_v_b.weight")
    tensor.data[0] *= -1  # one head's values flipped, written through the memory map
    reader.data.flush()
    del reader
    report = verify_paths(tmp_path / "src", tmp_path / "out", progress=False)
    assert report["verdict"] == "FAIL"


# ------------------------------------------------------------------ the real engine

_ENGINE_RUN = """
import json, sys, numpy as np, llama_cpp
path, ids, steps, flash = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
sys.path.insert(0, sys.argv[5])
import llamacpp_run  # weight repacking off, as the bench runs llama.cpp (AMX CPUs abort otherwise: docs/serving.md)
llm = llama_cpp.Llama(path, n_ctx=256, logits_all=True, verbose=False, n_threads=1, flash_attn=flash)
llm.eval(ids)
scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
logp = scores - np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scores.max(-1, keepdims=True)
greedy = []
for _ in range(steps):
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    greedy.append(token)
    llm.eval([token])
print(json.dumps({"logp": [float(logp[i, t]) for i, t in enumerate(ids[1:])], "greedy": greedy}))
"""


def engine_run(path, prompt: list[int], steps: int = 8, flash_attn: bool = False) -> dict:
    run = subprocess.run(
        [str(ENGINE), "-c", _ENGINE_RUN, str(path), json.dumps(prompt), str(steps), str(int(flash_attn)), str(BENCH)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def our_run(model, prompt: list[int], steps: int = 8) -> dict:
    with torch.no_grad():
        x = torch.tensor([prompt])
        logp = torch.log_softmax(model(x).logits[0].double(), -1)
        greedy = model.generate(x, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)[0, len(prompt) :]
    return {"logp": [float(logp[i, t]) for i, t in enumerate(prompt[1:])], "greedy": greedy.tolist()}


@pytest.mark.slow
@needs_engine
@pytest.mark.parametrize("flash_attn", [False, True], ids=["plain", "flash-attn"])
@pytest.mark.parametrize("n_kv_heads, head_dim", [(1, 64), (3, 64), (2, 128)])
def test_llama_cpp_computes_what_we_wrote(tmp_path, n_kv_heads, head_dim, flash_attn):
    """F32: llama.cpp's prompt log-probs within 1e-3 of our reading of the same file, greedy identical
    (one head: the original model itself; three, SmolLM2's shape: the lossy export's; two of 128, the
    Qwen2.5-1.5B's shape: a 128-dim rotary key), with llama.cpp's plain attention and with its flash
    attention (llama-cli's default, and the fast path for MLA)."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    lossy = {"calib": ids(64, 2), "text": text, "max_ppl_ratio": 2.0, "tokens": 64} if n_kv_heads > 1 else {}
    converted(tmp_path, tiny_llama(n_kv_heads, head_dim), **lossy)
    prompt = ids(32, 5)[0].tolist()
    ours = our_run(load(tmp_path / "out", "cpu", torch.float32), prompt)
    theirs = engine_run(tmp_path / "out" / "model.gguf", prompt, flash_attn=flash_attn)
    assert np.abs(np.array(ours["logp"]) - np.array(theirs["logp"])).max() < 1e-3
    assert ours["greedy"] == theirs["greedy"]


@pytest.mark.slow
@needs_engine
def test_llama_cpp_computes_a_zero_padded_latent_as_we_do(tmp_path):
    """--latent-multiple 128: llama.cpp's flash attention over the 256-wide latent (64 dims zero)
    gives our reading's log-probs within 1e-3, greedy identical."""
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    converted(tmp_path, tiny_llama(3), calib=ids(64, 2), text=text, max_ppl_ratio=2.0, tokens=64, latent_multiple=128)
    prompt = ids(32, 5)[0].tolist()
    ours = our_run(load(tmp_path / "out", "cpu", torch.float32), prompt)
    theirs = engine_run(tmp_path / "out" / "model.gguf", prompt, flash_attn=True)
    assert np.abs(np.array(ours["logp"]) - np.array(theirs["logp"])).max() < 1e-3
    assert ours["greedy"] == theirs["greedy"]
