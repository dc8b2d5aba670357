"""GGUF in: a GGUF file (llama.cpp's format) reads as the transformers checkpoint it was made from, in
transformers' names and layouts, dequantized a tensor at a time; `convert gqa2mla model.gguf` converts
and verifies it with its tokenizer carried; what cannot be read is refused in one line.

The files are written as llama.cpp's convert_hf_to_gguf.py writes them (`write_gguf`): its tensor names
(gguf's own name map), its metadata keys, Llama's q/k rows permuted for its interleaved RoPE, Gemma's
norms stored as 1 + w, 1-D tensors in F32."""

import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers.convert_slow_tokenizer import bytes_to_unicode

from convert.cli import main
from convert.errors import ConvertError
from convert.hf import load_original
from convert.io import open_checkpoint
from convert.io.gguf import GGUFCheckpoint
from convert.rope.scaling import llama3_factors
from convert.text import model_tokenizer

from conftest import REPO, hf_model, random_ids

Q = gguf.GGMLQuantizationType
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
ARCH |= {"phi3": "phi3", "olmo2": "olmo2"}
#: what llama.cpp can express of each tiny family (its query scale is head_dim's, its Gemma 3 has five
#: sliding layers to one global and a local RoPE base of 10000)
EXPRESSIBLE = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(query_pre_attn_scalar=16, layer_types=None, num_hidden_layers=2, rope_local_base_freq=10000.0),
}
#: blocks of the K-quants, bytes: where their f16 scales d (and dmin) sit (ggml's block_qN_K)
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# ------------------------------------------------------------------ writing GGUF as llama.cpp does


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(shape: tuple[int, ...], qtype, seed: int = 0) -> np.ndarray:
    """Stored bytes of a K-quant tensor of `shape` (torch order): random blocks with small finite scales
    (gguf cannot quantize to K-quants; any block is a valid one)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (math.prod(shape) // block, size), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        scales = rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def tiny_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of `vocab` single bytes, as a GPT-2-style GGUF stores it."""
    spelled = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([spelled[b] for b in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_scores([0.0] * vocab)  # no merges: transformers derives them (none) from the scores
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _metadata(writer: gguf.GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rotary = getattr(config, "partial_rotary_factor", None) or config.rope_parameters.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(head_dim * rotary))
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.pad_token_id is not None:
        writer.add_pad_token_id(config.pad_token_id)
    if config.model_type in ("gemma2", "gemma3_text", "phi3") and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def stored(hf_name: str, tensor: torch.Tensor, config) -> np.ndarray:
    """A transformers tensor as llama.cpp stores it (float32 numpy): q/k permuted (Llama), norms + 1 (Gemma)."""
    w = tensor.detach().float().numpy()
    if config.model_type == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        w = permute(w, config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads)
    if config.model_type in ("gemma2", "gemma3_text") and hf_name.endswith("norm.weight"):
        w = w + 1
    return w


def write_gguf(model, path: Path, qtype=Q.F32, tokenizer: bool = True, k_quants: dict | None = None) -> Path:
    """`model` (a transformers causal LM) as llama.cpp writes it: 2-D weights in `qtype`, other tensors
    F32; `k_quants` {hf name: K-quant type}: random blocks of that type instead of the weight."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), ARCH[config.model_type])
    _metadata(writer, config)
    writer.add_file_type({Q.F32: 0, Q.F16: 1, Q.BF16: 32, Q.Q8_0: 7, Q.Q4_0: 2, Q.Q5_0: 8}[qtype])
    if tokenizer:
        tiny_tokenizer(writer, config.vocab_size)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == ARCH[config.model_type])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, kind = hf.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{kind}"
        if k_quants and hf in k_quants:
            writer.add_tensor(name, random_blocks(tuple(tensor.shape), k_quants[hf]), raw_dtype=k_quants[hf])
            continue
        w = stored(hf, tensor, config)
        kind_type = qtype if w.ndim == 2 else Q.F32
        if kind_type == Q.F32:
            writer.add_tensor(name, w)
        elif kind_type == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind_type), raw_dtype=kind_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected(model, path: Path) -> dict[str, torch.Tensor]:
    """What a reader must give: each tensor as stored, brought back to transformers' layout with the
    gguf package's own dequantization (transformers' GGUF loader's, a tensor at a time)."""
    reader = gguf.GGUFReader(str(path))
    config, out = model.config, {}
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == ARCH[config.model_type])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    by_gguf = {f"{names.get_name(hf.rsplit('.', 1)[0])}.{hf.rsplit('.', 1)[1]}": hf for hf in model.state_dict()}
    for t in reader.tensors:
        hf, raw = by_gguf[t.name], np.array(t.data)
        if t.tensor_type in (Q.F16, Q.BF16):
            w = torch.frombuffer(
                bytearray(raw.tobytes()), dtype=torch.float16 if t.tensor_type == Q.F16 else torch.bfloat16
            )
        else:
            w = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type))
        w = w.reshape(tuple(reversed(t.shape.tolist())))
        if config.model_type == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            n = config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
        if config.model_type in ("gemma2", "gemma3_text") and hf.endswith("norm.weight"):
            w = w.float() - 1
        out[hf] = w
    return out


def tiny(family: str, tied: bool = False, **overrides):
    """The suite's tiny `family` model as llama.cpp can express it; `tied`: its lm_head the embedding."""
    model = hf_model(family, **{**EXPRESSIBLE.get(family, {}), **overrides})
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# ------------------------------------------------------------------ every family, as stored


@pytest.mark.parametrize("family", list(ARCH))
def test_family_reads_as_transformers_model(tmp_path, family):
    """F32: every tensor exactly the original's, in its name; the config describes the same model
    (transformers built from it computes the original's logits, to the bit)."""
    model = tiny(family, tied=family.startswith("gemma"))
    path = write_gguf(model, tmp_path / "tiny.gguf")
    with open_checkpoint(path) as source:
        assert isinstance(source, GGUFCheckpoint)
        tied = model.config.tie_word_embeddings
        state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        assert sorted(source.keys()) == sorted(state)
        for name, tensor in state.items():
            got = source.read(name)
            assert got.dtype == torch.float32 and tuple(source.shape(name)) == tuple(tensor.shape)
            if family.startswith("gemma") and name.endswith("norm.weight"):
                assert torch.allclose(got, tensor, atol=1e-6), name  # (w + 1) - 1 in float32
            else:
                assert torch.equal(got, tensor), name
        assert source.config["model_type"] == model.config.model_type
        assert source.config["tie_word_embeddings"] == model.config.tie_word_embeddings
        rebuilt = load_original(source, source.config, "cpu", torch.float32)
    ids = random_ids()
    with torch.no_grad():
        ref, got = model(ids).logits, rebuilt(ids).logits
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_half_types_read_as_stored(tmp_path, qtype):
    """F16 and BF16: the stored type, the stored values (the original rounded once), norms F32."""
    model = tiny("llama")
    path = write_gguf(model, tmp_path / "tiny.gguf", qtype)
    dtype = torch.float16 if qtype == Q.F16 else torch.bfloat16
    with open_checkpoint(path) as source:
        assert source.config["torch_dtype"] == str(dtype).removeprefix("torch.")
        assert source.quantization is None and "read as stored" in source.description
        for name, tensor in model.state_dict().items():
            want = tensor if tensor.ndim == 1 else tensor.to(dtype)
            assert source.dtype(name) == want.dtype and torch.equal(source.read(name), want), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0])
def test_legacy_quants_dequantized(tmp_path, qtype):
    model = tiny("llama")
    path = write_gguf(model, tmp_path / "tiny.gguf", qtype)
    want = expected(model, path)
    with open_checkpoint(path) as source:
        assert source.quantization == qtype.name and "dequantized to float32" in source.description
        for name, tensor in want.items():
            assert source.dtype(name) == torch.float32
            assert torch.equal(source.read(name), tensor.float()), name
        q = source.read("model.layers.0.self_attn.q_proj.weight")  # close to the original, not equal
        assert 0 < (q - model.state_dict()["model.layers.0.self_attn.q_proj.weight"]).abs().max() < 0.2


def test_k_quants_dequantized(tmp_path):
    """Q2_K … Q6_K (Q4_K_M files hold Q4_K and Q6_K): exactly what the gguf package dequantizes."""
    model = tiny("llama", hidden_size=256, head_dim=64, intermediate_size=256)
    k_quants = {
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
        "model.layers.0.self_attn.k_proj.weight": Q.Q5_K,
        "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
        "model.layers.0.mlp.up_proj.weight": Q.Q2_K,
        "model.layers.0.mlp.gate_proj.weight": Q.Q3_K,
        "model.embed_tokens.weight": Q.Q6_K,
    }
    path = write_gguf(model, tmp_path / "tiny.gguf", k_quants=k_quants)
    want = expected(model, path)
    with open_checkpoint(path) as source:
        for name in k_quants:
            assert torch.equal(source.read(name), want[name]), name
            assert torch.equal(source.read_rows(name, 3, 9), want[name][3:9]), name
        assert torch.isfinite(source.read("model.layers.0.self_attn.q_proj.weight")).all()


def test_reading_verbs_agree(tmp_path, monkeypatch):
    """read, read_rows, read_into, raw_chunks and raw_span give the same values, a piece at a time too."""
    monkeypatch.setattr("convert.io.gguf.DEQUANT_CHUNK", 4 * 64 * 3)  # three rows a piece
    monkeypatch.setattr("convert.io.gguf.RAW_CHUNK", 64 * 4 * 5)
    model = tiny("llama")
    for qtype in (Q.F32, Q.Q8_0):
        path = write_gguf(model, tmp_path / f"{qtype.name}.gguf", qtype)
        with open_checkpoint(path) as source:
            for name in source.keys():
                whole = source.read(name)
                assert torch.equal(source.read_rows(name, 1, 4), whole[1:4])
                assert torch.equal(source.read_rows(name, 5, 10**6), whole[5:])
                target = torch.empty(whole.shape, dtype=torch.float64)
                source.read_into(name, target)
                assert torch.equal(target, whole.double())
                raw = b"".join(bytes(c) for c in source.raw_chunks(name, 100))
                assert raw == whole.contiguous().view(torch.uint8).numpy().tobytes()
                span = source.raw_span(name)
                if span is not None:
                    file, offset, nbytes = span
                    assert file.read_bytes()[offset : offset + nbytes] == raw
            assert source.raw_span("model.layers.0.self_attn.q_proj.weight") is None  # permuted
            assert source.total_bytes() == sum(4 * t.numel() for t in model.state_dict().values())


def test_config_matches_llama_cpp_metadata(tmp_path):
    """The config.json keys a published one has: ids, eps as the model's decimal, head_dim when it
    is not hidden/heads, tied embeddings when there is no output.weight, the dtype."""
    model = tiny("llama", tied=True)
    with open_checkpoint(write_gguf(model, tmp_path / "tiny.gguf", Q.BF16)) as source:
        config = source.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == model.config.rms_norm_eps and config["rope_theta"] == 10000.0
    assert "head_dim" not in config  # 64 / 4 heads: transformers computes it
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 128
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (1, 2, "bfloat16")


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.x: llama.cpp keeps its rope_scaling only as the rope_freqs tensor; the config gets it back."""
    model = tiny("llama", tied=True)
    path = tmp_path / "tiny.gguf"
    factors = np.array(llama3_factors(10000.0, 16, 8.0, 1.0, 4.0, 8192), dtype=np.float32)
    write_gguf(model, path)
    data = _with_tensor(path, "rope_freqs.weight", factors)
    with open_checkpoint(data) as source:
        assert source.config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert "rope_freqs.weight" not in source.keys()
    factors[2] *= 1.5  # no Llama 3 scaling gives these: refused, not guessed
    with pytest.raises(ConvertError, match="rope_freqs"):
        open_checkpoint(_with_tensor(path, "rope_freqs.weight", factors))


def _with_tensor(path: Path, name: str, values: np.ndarray) -> Path:
    """A copy of the GGUF at `path` with one more F32 tensor."""
    reader = gguf.GGUFReader(str(path))
    out = path.with_name(f"{path.stem}-{name}.gguf")
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        writer.add_tensor(t.name, np.array(t.data), raw_shape=shape, raw_dtype=t.tensor_type)
    writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ------------------------------------------------------------------ the command line


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _refused(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.slow
def test_cli_converts_gguf_and_carries_its_tokenizer(tmp_path):
    """`convert gqa2mla tiny.gguf` (Q8_0): exit 0, PASS against the dequantized model, the tokenizer
    files beside the weights, and the converted directory tokenizes as the GGUF does."""
    torch.set_num_threads(1)
    model = tiny("llama")
    path = write_gguf(model, tmp_path / "tiny.gguf", Q.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man. " * 20)
    out = tmp_path / "tiny-mla"
    result = _run("gqa2mla", path, "-o", out, "--text", text, "--tokens", "64")
    assert result.exit_code == 0, result.output
    assert "verification: PASS" in result.output
    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "PASS" and report["inputs"]["original"]["files"].keys() == {"tiny.gguf"}
    assert "Q8_0" in report["inputs"]["original"]["description"]  # the report says what it compared against
    assert "dequantized to float32" in (out / "verification.md").read_text()
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    ours, theirs = model_tokenizer(out), model_tokenizer(path)
    assert ours("a truth")["input_ids"] == theirs("a truth")["input_ids"] == list(b"a truth")
    verify = _run("verify", path, out)
    assert verify.exit_code == 0, verify.output


def test_cli_refuses_unreadable_types_and_architectures(tmp_path):
    model = tiny("llama", hidden_size=256, head_dim=64, intermediate_size=256)
    path = write_gguf(model, tmp_path / "tiny.gguf", k_quants={"model.layers.0.self_attn.q_proj.weight": Q.Q4_K})
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    # the type field sits just before the offset field of the tensor info, itself followed by the next one
    at = data.find(q.name.encode()) + len(q.name) + 4 + 8 * 2
    data[at : at + 4] = int(Q.IQ2_XXS).to_bytes(4, "little")
    (tmp_path / "iq.gguf").write_bytes(data)
    _refused(_run("gqa2mla", tmp_path / "iq.gguf", "--no-verify"), "IQ2_XXS", "blk.0.attn_q.weight")
    arch = bytes(data).replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00mamba", 1)
    (tmp_path / "mamba.gguf").write_bytes(arch)
    _refused(_run("gqa2mla", tmp_path / "mamba.gguf", "--no-verify"), "mamba")
    (tmp_path / "text.gguf").write_text("not a gguf file at all, just text")
    _refused(_run("gqa2mla", tmp_path / "text.gguf", "--no-verify"), "GGUF")


# Runs the console entry point in a fresh interpreter, then says whether it imported torch.
LIGHT = """
import importlib, sys
sys.argv = ["convert", *sys.argv[1:]]
try:
    importlib.import_module("cli").main()
except SystemExit as stop:
    print("torch" in sys.modules, stop.code)
"""


def test_malformed_gguf_refused_before_torch(tmp_path):
    """The command line checks a GGUF's whole header before it imports torch (`convert.io.locate`)."""
    path = write_gguf(tiny("llama"), tmp_path / "tiny.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:300])
    done = subprocess.run(
        [sys.executable, "-c", LIGHT, "gqa2mla", str(tmp_path / "cut.gguf")], capture_output=True, text=True, cwd=REPO
    )
    assert done.stdout.split() == ["False", "2"], done.stderr
    assert done.stderr.count("\n") == 1 and "not a readable GGUF file" in done.stderr, done.stderr


def test_unknown_tensor_refused(tmp_path):
    model = tiny("llama")
    path = _with_tensor(write_gguf(model, tmp_path / "tiny.gguf"), "blk.0.attn_sinks.weight", np.ones(4, np.float32))
    with pytest.raises(ConvertError, match="attn_sinks"):
        open_checkpoint(path)


def test_directory_with_one_gguf(tmp_path):
    (tmp_path / "m").mkdir()
    write_gguf(tiny("qwen2"), tmp_path / "m" / "model.gguf")
    with open_checkpoint(tmp_path / "m") as source:
        assert source.path == tmp_path / "m" / "model.gguf" and source.config["model_type"] == "qwen2"


# ------------------------------------------------------------------ the real Q4_K_M file


# The peak is this process's VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork and
# exec, so a child of a 12 GB pytest reported 12 GB whatever it read (bench/convert_speed.py says the same).
MEASURE = """
import sys, time
from convert.io import open_checkpoint
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
t0 = time.perf_counter()
with open_checkpoint(sys.argv[1]) as source:
    before, biggest = status("VmRSS"), 0
    for name in source.keys():
        biggest = max(biggest, source.read(name).numel() * 4)
print(before, status("VmHWM"), biggest, time.perf_counter() - t0)
"""


@pytest.mark.realdata
@pytest.mark.slow
def test_qwen25_coder_q4_k_m_as_transformers_reads_it():
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the config transformers builds from the file, and a few
    tensors (Q4_K, Q6_K, F32 biases; embeddings read by rows) equal to transformers' dequantization of
    the same tensors."""
    realdata = pytest.importorskip("realdata")
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = realdata.qwen25_coder_gguf()
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    with open_checkpoint(path) as source:
        assert "Q4_K_M" in source.description
        ours = AutoConfig.for_model(**source.config).to_dict()
        want = AutoConfig.for_model(**theirs).to_dict()
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "rope_parameters", "bos_token_id",
                    "eos_token_id", "pad_token_id", "model_type"):  # fmt: skip
            assert ours[key] == want[key], key
        assert math.isclose(ours["rms_norm_eps"], want["rms_norm_eps"], rel_tol=1e-7)
        reader = gguf.GGUFReader(str(path))
        stored = {t.name: t for t in reader.tensors}
        for gguf_name, hf in [
            ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
            ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
            ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
            ("blk.27.ffn_down.weight", "model.layers.27.mlp.down_proj.weight"),
        ]:
            t = stored[gguf_name]
            want_tensor = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            assert torch.equal(source.read(hf), want_tensor.reshape(source.shape(hf))), hf
        embed = stored["token_embd.weight"]
        rows = gguf.quants.dequantize(np.array(embed.data[1000:1003]), embed.tensor_type)
        assert torch.equal(source.read_rows("model.embed_tokens.weight", 1000, 1003), torch.from_numpy(rows))


@pytest.mark.realdata
@pytest.mark.slow
def test_qwen25_coder_peak_memory_is_one_tensor():
    """Reading every tensor of the 1.1 GB Q4_K_M file in turn holds about one dequantized tensor
    (the largest: the 0.93 GB float32 embedding), not the 6 GB model."""
    realdata = pytest.importorskip("realdata")
    path = realdata.qwen25_coder_gguf()
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    before, peak, biggest, seconds = map(float, done.stdout.split())
    print(f"\nRSS {before / 2**30:.2f} GiB open, peak {peak / 2**30:.2f} GiB reading every tensor in turn; largest "
          f"tensor {biggest / 2**30:.2f} GiB (file {path.stat().st_size / 2**30:.2f} GiB), {seconds:.0f} s")  # fmt: skip
    assert peak - before < biggest + 0.25 * 2**30
