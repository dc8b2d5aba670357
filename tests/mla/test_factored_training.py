"""`convert.factored_training`: an absorbed model's query and output maps trained as their factors
(convert/mla/lowrank.py). The same model inside as outside, the same checkpoint names and values,
a `Trainer` that trains it and writes an absorbed checkpoint, and maps left dense where the factored
form would change them; on the tiny Llama and on SmolLM2 in float32 and bfloat16."""

import copy
import re

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import convert
from convert.mla.lowrank import FactoredOutput, FactoredQuery, absorb_factors, factor_absorbed

from conftest import TINY_LLAMA, TokenDataset, random_ids, rel_err


@pytest.fixture(scope="module")
def original():
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _maps(model):
    return [(a.q_absorbed, a.o_absorbed) for a in (layer.self_attn for layer in model.model.layers)]


def test_the_same_model_inside_and_out(original):
    """Factored: every map of every layer (the exact rank, 2·16 dims a head against d = 16), the same
    logits, the same state dict (names and values); multiplied back on exit, dense `nn.Linear`s again."""
    model = convert.to_mla(original, layout="absorbed")
    ids = random_ids()
    dense_logits, dense_state = _logits(model, ids), model.state_dict()
    with convert.factored_training(model) as counts:
        assert counts == {"factored": 2 * len(model.model.layers), "dense": 0}
        assert all(isinstance(q, FactoredQuery) and isinstance(o, FactoredOutput) for q, o in _maps(model))
        assert rel_err(_logits(model, ids), dense_logits) < 1e-5
        state = model.state_dict()
        assert list(state) == list(dense_state)
        assert max(rel_err(state[k], dense_state[k]) for k in state) < 1e-6
        factors = sum(p.numel() for q, o in _maps(model) for p in [*q.parameters(), *o.parameters()])
        dense = sum(dense_state[k].numel() for k in dense_state if "_absorbed." in k)
        assert factors < 0.8 * dense  # H·d·(D + r) against H·r·D a map
    assert all(type(q) is nn.Linear and type(o) is nn.Linear for q, o in _maps(model))
    assert rel_err(_logits(model, ids), dense_logits) < 1e-5


def test_a_dense_state_dict_loads_into_the_factors(original):
    """load_state_dict of the dense names factors them: a changed (still rank-d) map comes in; a map
    not of rank d is refused, naming it, where factors would have silently changed it."""
    model = convert.to_mla(original, layout="absorbed")
    other = convert.to_mla(original, layout="absorbed")
    with torch.no_grad():  # another map of rank d: a head's rows scaled
        other.model.layers[1].self_attn.q_absorbed.weight.mul_(1.5)
    ids = random_ids()
    with convert.factored_training(model):
        model.load_state_dict(other.state_dict())
        assert rel_err(_logits(model, ids), _logits(other, ids)) < 1e-5
        full, name = other.state_dict(), "model.layers.0.self_attn.o_absorbed.weight"
        full[name] = torch.randn_like(full[name])  # of full rank
        with pytest.raises(RuntimeError, match=rf"{re.escape(name)}: a head's map is not of rank 16"):
            model.load_state_dict(full)


@pytest.mark.slow
def test_maps_that_would_change_or_gain_nothing_stay_dense(original):
    """A map trained dense (no longer of rank d a head) stays dense; so do a compression's maps
    narrower than d (a quarter of the cache, where the allocation gives some layers fewer than
    d = 16 dims) and those its refinement fitted whole; the model is the same."""
    model = convert.to_mla(original, layout="absorbed")
    with torch.no_grad():
        q = model.model.layers[0].self_attn.q_absorbed.weight
        q.add_(1e-2 * torch.randn_like(q))
    assert factor_absorbed(model) == {"factored": 3, "dense": 1}
    assert type(model.model.layers[0].self_attn.q_absorbed) is nn.Linear
    assert absorb_factors(model) == 3
    calib = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(7))
    compressed = convert.to_mla(original, layout="absorbed", kv_cache_ratio=0.25, calib=calib)
    attentions = [layer.self_attn for layer in compressed.model.layers]
    ranks = [(a.rank_k, a.rank_v) for a in attentions]
    assert min(map(min, ranks)) <= 16, ranks  # some map is narrower than d
    ids = random_ids()
    dense_logits = _logits(compressed, ids)
    counts = factor_absorbed(compressed)
    assert counts["factored"] + counts["dense"] == 4
    for a, (rank_k, rank_v) in zip(attentions, ranks):
        for name, rank, kind in (("q_absorbed", rank_k, FactoredQuery), ("o_absorbed", rank_v, FactoredOutput)):
            linear = getattr(a, name)
            if isinstance(linear, kind):
                assert rank > 16
                continue
            assert type(linear) is nn.Linear
            if rank > 16:  # refined as a whole (convert.compress.refine): its heads are not of rank d
                w = linear.weight.double()
                heads = w.view(4, rank, -1) if name == "q_absorbed" else w.view(w.shape[0], 4, rank).transpose(0, 1)
                s = torch.linalg.svdvals(heads)  # (H, rank)
                assert (s[:, 16:].norm(dim=-1) / s.norm(dim=-1)).max() > 1e-3
    assert rel_err(_logits(compressed, ids), dense_logits) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_range_finder_factors_as_the_svd_does(original, monkeypatch, dtype):
    """The large maps' path (`_range`, a Llama-3-8B head's 1,024 × 4,096), forced on the tiny maps:
    the same model as the full SVD's factors to the dtype's rounding, and a map not of rank d refused."""
    import convert.mla.lowrank as lowrank

    ids = random_ids()
    models = {}
    for name, full_svd_dim in (("svd", lowrank.FULL_SVD_DIM), ("range", 0)):
        monkeypatch.setattr(lowrank, "FULL_SVD_DIM", full_svd_dim)
        model = convert.to_mla(copy.deepcopy(original).to(dtype), layout="absorbed")
        assert factor_absorbed(model) == {"factored": 4, "dense": 0}
        models[name] = _logits(model, ids)
    dense = _logits(convert.to_mla(copy.deepcopy(original).to(dtype), layout="absorbed"), ids)
    tol = 1e-5 if dtype == torch.float32 else 4 * rel_err(models["svd"], dense)
    assert rel_err(models["range"], dense) <= tol, (rel_err(models["range"], dense), rel_err(models["svd"], dense))
    heads = torch.randn(4, 32, 64, dtype=torch.float64)  # of full rank 32
    assert lowrank._head_factors(heads, 16, dtype) is None
    assert lowrank._head_factors(heads[:, :, :16] @ torch.randn(4, 16, 64, dtype=torch.float64), 16, dtype)


@pytest.mark.slow
def test_trainer_trains_the_factors_and_writes_an_absorbed_checkpoint(original, tmp_path):
    """transformers' Trainer (gradient checkpointing, accumulation, a checkpoint at its last step)
    inside the context: the loss falls, the factors move, and both the checkpoint Trainer wrote inside
    and `save_pretrained` after reload through Auto as the model trained, with no key missing."""
    from transformers import Trainer, TrainingArguments

    model = convert.to_mla(original, layout="absorbed")
    data = TokenDataset()
    ids = data.ids
    before = model(input_ids=ids, labels=ids).loss.item()
    with convert.factored_training(model):
        up = model.model.layers[0].self_attn.q_absorbed.up.detach().clone()
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"),
            use_cpu=True,
            report_to=[],
            max_steps=6,
            gradient_checkpointing=True,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            save_strategy="steps",
            save_steps=6,
            disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=data).train()
        assert not torch.equal(model.model.layers[0].self_attn.q_absorbed.up, up)
        inside = _logits(model, ids)
    model.eval()
    after = model(input_ids=ids, labels=ids).loss.item()
    assert after < before - 0.05, (before, after)
    assert rel_err(_logits(model, ids), inside) < 1e-5
    model.save_pretrained(tmp_path / "saved")
    for path in (tmp_path / "run" / "checkpoint-6", tmp_path / "saved"):
        reloaded, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert rel_err(_logits(reloaded, ids), inside) < 1e-5


@pytest.mark.slow
@pytest.mark.realdata
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_smollm2_factored_is_the_absorbed_model(smollm2_original, emma_ids, dtype):
    """SmolLM2 (r = G·d = 192 dims a head against d = 64): every map factored, the same model inside
    and after. float32: the dense absorbed model's logits to 1e-5. bfloat16, where the factors and
    their product are rounded again: as close to the float32 original as the original itself is in
    bfloat16 (its rounding, the floor), within a quarter (measured: the floor 0.0162, the dense
    absorbed model 0.0175, inside 0.0187, after 0.0195; the factored layout 0.0195)."""
    source = copy.deepcopy(smollm2_original).to(dtype)  # the session's float32 model left as it is
    model = convert.to_mla(source, layout="absorbed")
    ids = emma_ids[:, :128]
    dense = _logits(model, ids)
    with convert.factored_training(model) as counts:
        assert counts == {"factored": 60, "dense": 0}
        inside = _logits(model, ids)
    after = _logits(model, ids)
    if dtype == torch.float32:
        assert rel_err(inside, dense) < 1e-5 and rel_err(after, dense) < 1e-5
        return
    exact = _logits(smollm2_original, ids)
    floor = rel_err(_logits(source, ids), exact)
    errors = [rel_err(dense, exact), rel_err(inside, exact), rel_err(after, exact)]
    assert max(errors) <= 1.25 * floor, (errors, floor)
