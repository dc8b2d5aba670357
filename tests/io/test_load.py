"""Loading builds the model with no storage for its weights, then reads each tensor once straight
into storage allocated on the target device: no random initialisation (a guard makes any random
fill of real memory raise), the checkpoint's own values, the buffers a module computes for itself
(RoPE frequencies, Gemma 3's embedding scale), and the same logits as a model built the way
transformers builds any model (randomly initialised, then overwritten)."""

import contextlib
import importlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import convert
from convert.hf import hf_config, load_original, load_pretrained, reference_attention
from convert.io import open_checkpoint
from convert.io.reader import Checkpoint
from convert.mla.causal_lm import MLAForCausalLM
from convert.mla.model import read_mla_config, swap_attention

from conftest import TINY_LLAMA, hf_model

RANDOM_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_")


def tied_llama():
    """A tiny Llama whose lm_head is its embedding (SmolLM2's layout)."""
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=128,
        num_hidden_layers=2,
        initializer_range=0.15,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def llama3_config_json(directory):
    """Tiny Llama weights under a config.json written as Llama 3's are: legacy `rope_scaling`
    (llama3 scaling) beside `rope_theta`, which transformers converts when it reads them."""
    AutoModelForCausalLM.from_pretrained(TINY_LLAMA).save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config |= {"rope_theta": 500000.0, "rope_scaling": {**scaling, "rope_type": "llama3"}}
    (directory / "config.json").write_text(json.dumps(config))


def _saved(build):
    return lambda directory: build().save_pretrained(directory, safe_serialization=True)


SOURCES = {  # name -> writes the source checkpoint into a directory
    "llama": _saved(lambda: AutoModelForCausalLM.from_pretrained(TINY_LLAMA)),
    "llama-tied": _saved(tied_llama),
    "llama3-rope": llama3_config_json,
    "gemma3": _saved(lambda: hf_model("gemma3_text")),  # a non-persistent embed_scale buffer, a RoPE per layer type
}


@pytest.fixture(scope="module", params=[(s, layout) for s in SOURCES for layout in ("absorbed", "factored")], ids=str)
def converted(request, tmp_path_factory):
    """(source dir, converted dir) for each source model and layout."""
    name, layout = request.param
    root = tmp_path_factory.mktemp(f"load-{name}-{layout}")
    SOURCES[name](root / "src")
    convert.gqa2mla(root / "src", root / "mla", layout=layout, verify=False, progress=False)
    return root / "src", root / "mla"


def _guard(name, fill):
    def refuse(tensor, *args, **kwargs):
        if tensor.device.type != "meta":  # building on the meta device costs nothing
            raise AssertionError(f"{name} filled a {tuple(tensor.shape)} tensor: loading must not initialise weights")
        return fill(tensor, *args, **kwargs)

    return refuse


@contextlib.contextmanager
def no_random_init():
    """Any random fill of real memory raises inside: torch's init functions, transformers' copies
    of them, and the tensor methods they all end in."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("normal_", "uniform_"):
            monkeypatch.setattr(torch.Tensor, name, _guard(f"Tensor.{name}", getattr(torch.Tensor, name)))
        # transformers' own module, whatever its package attribute says: one test module (lm_eval's
        # imports) can leave `transformers.initialization` unset while modeling_utils holds it.
        copies = importlib.import_module("transformers.initialization").TORCH_INIT_FUNCTIONS
        for name in RANDOM_FILLS:
            monkeypatch.setattr(torch.nn.init, name, _guard(f"torch.nn.init.{name}", getattr(torch.nn.init, name)))
            monkeypatch.setitem(copies, name, _guard(f"transformers' {name}", copies[name]))
        yield


def _ids(n: int = 20) -> torch.Tensor:
    return torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def reference_mla_model(out):
    """The converted model built as before loading was made fast: transformers' own class, randomly
    initialised, attention swapped, then overwritten with the checkpoint's tensors."""
    config, mla = read_mla_config(out)
    model = AutoModelForCausalLM.from_config(hf_config(config, torch.float32), dtype=torch.float32)
    swap_attention(model, mla)
    missing, unexpected = model.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


def test_the_guard_catches_random_initialisation():
    with no_random_init(), pytest.raises(AssertionError, match="must not initialise"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA))


def test_no_load_path_initialises_weights(converted):
    src, out = converted
    config = json.loads((src / "config.json").read_text())
    with no_random_init():
        convert.load_mla_model(out)
        convert.load_mla_model(out, dtype="bfloat16")
        AutoModelForCausalLM.from_pretrained(out)
        with open_checkpoint(src) as original:
            load_original(original, config, "cpu", torch.float32)
        model = AutoModelForCausalLM.from_pretrained(src).eval()
        convert.to_mla(model, layout=read_mla_config(out)[1].layout)


def test_no_export_path_initialises_weights(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    convert.gqa2mla(TINY_LLAMA, tmp_path / "export", target="transformers", verify=False, progress=False)
    with no_random_init():
        load_pretrained(tmp_path / "export", "cpu", torch.float32)
        convert.to_mla(model, target="transformers")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bfloat16"])
def test_each_tensor_is_read_once_into_the_model(converted, monkeypatch, dtype):
    _, out = converted
    reads = []
    get, read_into = Checkpoint.get, Checkpoint.read_into

    def counted(read):
        def count(self, name, *target):
            reads.append(name)
            return read(self, name, *target)

        return count

    monkeypatch.setattr(Checkpoint, "get", counted(get))
    monkeypatch.setattr(Checkpoint, "read_into", counted(read_into))
    for name in ("read", "read_rows"):
        monkeypatch.setattr(Checkpoint, name, lambda *a, n=name: pytest.fail(f"Checkpoint.{n}: a second copy"))
    convert.load_mla_model(out, dtype=dtype)
    assert sorted(reads) == sorted(load_file(out / "model.safetensors"))


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_a_cpu_load_in_the_stored_dtype_copies_nothing(converted):
    """In the stored dtype the weights are the file's own pages, mapped copy-on-write (as transformers
    loads on the CPU); in another dtype each weight owns the memory it was read into."""
    _, out = converted
    file = (out / "model.safetensors").resolve()
    inside = lambda p, ranges: any(start <= p.data_ptr() < end for start, end in ranges)
    model = convert.load_mla_model(out)
    ranges = _mapped_ranges(file)
    assert ranges and all(inside(p, ranges) for p in model.parameters())
    model.model.embed_tokens.weight.data[0, 0] = 7.0  # written to this process's copy only
    assert float(load_file(file)["model.embed_tokens.weight"][0, 0]) != 7.0
    converted = convert.load_mla_model(out, dtype=torch.bfloat16)
    assert not any(inside(p, _mapped_ranges(file)) for p in converted.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_are_the_checkpoints(converted, dtype):
    _, out = converted
    model = convert.load_mla_model(out, dtype=dtype)
    stored = load_file(out / "model.safetensors")
    state = model.state_dict()
    assert set(stored) <= set(state) and set(state) - set(stored) <= {"lm_head.weight"}
    for name, tensor in stored.items():
        assert state[name].dtype == dtype and torch.equal(state[name], tensor.to(dtype)), name
    if "lm_head.weight" not in stored:  # tied: one tensor, not a copy
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_computed_buffers_are_built_for_real(converted):
    _, out = converted
    model, reference = convert.load_mla_model(out), reference_mla_model(out)
    buffers = dict(reference.named_buffers())
    assert buffers and dict(model.named_buffers()).keys() == buffers.keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_logits_equal_the_reference(converted):
    src, out = converted
    reference = _logits(reference_mla_model(out))
    model = convert.load_mla_model(out)
    assert type(model) is MLAForCausalLM
    assert torch.equal(_logits(model), reference)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), reference)
    config = json.loads((src / "config.json").read_text())
    with open_checkpoint(src) as original:
        ours = load_original(original, config, "cpu", torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(src, attn_implementation=reference_attention(config)).eval()
    assert torch.equal(_logits(ours), _logits(theirs))


def test_an_unusable_device_or_dtype_is_refused(converted, monkeypatch):
    _, out = converted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(convert.ConvertError, match="CUDA is not available.*pass device='cpu'"):
        convert.load_mla_model(out, device="cuda")
    with pytest.raises(convert.ConvertError, match="not a torch device"):
        convert.load_mla_model(out, device="gpu0")
    with pytest.raises(convert.ConvertError, match="'float8' is not one of"):
        convert.load_mla_model(out, dtype="float8")


def test_a_model_built_from_its_config_is_still_initialised(converted):
    """Outside loading, `MLAForCausalLM(config)` initialises its weights (randomly, once), as any
    transformers model does."""
    _, out = converted
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    first = MLAForCausalLM(config)
    torch.manual_seed(0)
    second = MLAForCausalLM(config)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert a.isfinite().all() and torch.equal(a, b), name
    attention = first.model.layers[0].self_attn
    weight = (getattr(attention, "o_absorbed", None) or attention.o_proj).weight
    assert 0.5 * config.initializer_range < float(weight.detach().std()) < 2 * config.initializer_range


def test_generate_sees_the_padding_mask(converted):
    """`generate` reads the model's forward signature to pass the mask of padding tokens: the
    converted model (loaded either way) must take it as the original does."""
    src, out = converted
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    prompt = torch.tensor([[5, 0, 17, 0, 33, 8, 0, 21]])  # 0 is the pad token: generate masks it out
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = original.generate(prompt, **greedy)
    for model in (convert.load_mla_model(out), AutoModelForCausalLM.from_pretrained(out)):
        assert torch.equal(model.generate(prompt, **greedy), expected)
