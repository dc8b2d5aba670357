"""`convert.to_mla(model, **options)`: a live transformers model converted in memory is the
same module, with the same weights and logits, as `load_mla_model` of the directory
`gqa2mla` writes from that model saved to disk (an export target's: the DeepseekV3 model
`load_export` reads); and it trains in an ordinary loop."""

import pytest
import torch

import convert

from conftest import hf_model

CASES = [
    ("llama", {"layout": "absorbed"}),
    ("llama", {"layout": "factored"}),
    ("qwen2", {"layout": "absorbed"}),
    ("mistral", {"layout": "factored", "kv_cache_ratio": 0.5, "method": "whitened"}),
]


def _calib_ids(n: int = 64) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(7))


def _options(options: dict) -> dict:
    return {**options, "calib": _calib_ids()} if options.get("method") == "whitened" else options


@pytest.mark.parametrize(
    ("model_type", "options"), CASES, ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c.values()))
)
@pytest.mark.slow
def test_to_mla_equals_the_cli_path(tmp_path, model_type, options):
    model = hf_model(model_type)
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    in_memory = convert.to_mla(model, **_options(options))
    convert.gqa2mla(tmp_path / "src", tmp_path / "out", verify=False, progress=False, **_options(options))
    from_disk = convert.load_mla_model(tmp_path / "out")

    assert type(in_memory) is type(from_disk)
    got, want = in_memory.state_dict(), from_disk.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = _calib_ids(24)
    with torch.no_grad():
        assert torch.equal(in_memory(ids).logits, from_disk(ids).logits)
    # and it is the conversion: exact ones reproduce the original
    if "kv_cache_ratio" not in options:
        with torch.no_grad():
            ref = model(ids).logits
            assert float((in_memory(ids).logits - ref).norm() / ref.norm()) < 1e-5


def test_to_mla_leaves_the_model_alone_and_keeps_dtype():
    model = hf_model("llama", dtype=torch.float64)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    converted = convert.to_mla(model, layout="factored")
    assert next(converted.parameters()).dtype == torch.float64
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert any(".self_attn.k_proj." in name for name in model.state_dict())


def test_to_mla_trains_in_an_ordinary_loop():
    model = convert.to_mla(hf_model("llama"))
    model.train()
    ids = _calib_ids(32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert any(".self_attn." in name for name in changed)
    assert model(ids, labels=ids).loss.item() < loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["transformers", "vllm"])
def test_to_mla_export_target_equals_the_loaded_export(tmp_path, target):
    """An export target in memory is the DeepseekV3ForCausalLM `load_export` reads from the
    directory `gqa2mla` writes: the same tensors and logits (the vllm one calibrated, G = 3)."""
    from tiny_models import tiny_llama

    from convert.verify import load_export

    model = tiny_llama(3) if target == "vllm" else hf_model("llama")
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    options = {"target": target} | ({"calib": _calib_ids()} if target == "vllm" else {})
    in_memory = convert.to_mla(model, **options)
    convert.gqa2mla(tmp_path / "src", tmp_path / "out", verify=False, progress=False, **options)
    from_disk = load_export(tmp_path / "out", "cpu", torch.float32)

    assert type(in_memory).__name__ == "DeepseekV3ForCausalLM" and type(in_memory) is type(from_disk)
    got, want = in_memory.state_dict(), from_disk.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    eps = {m.variance_epsilon for name, m in in_memory.named_modules() if name.endswith("kv_a_layernorm")}
    assert len(eps) == 1 and eps == {
        m.variance_epsilon for name, m in from_disk.named_modules() if name.endswith("kv_a_layernorm")
    }
    ids = _calib_ids(24)
    with torch.no_grad():
        assert torch.equal(in_memory(ids).logits, from_disk(ids).logits)
        if target == "transformers":  # exact: it reproduces the original
            ref = model(ids).logits
            assert float((in_memory(ids).logits - ref).norm() / ref.norm()) < 1e-5


def test_to_mla_vllm_refuses_as_the_cli_does():
    from tiny_models import tiny_llama

    with pytest.raises(convert.ConvertError, match="calib"):
        convert.to_mla(tiny_llama(3), target="vllm")
