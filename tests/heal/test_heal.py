"""Healing (`convert.heal`, `convert heal`): KL distillation of a compressed conversion toward
the original. The KL on held-out tokens goes down, only the MLA projections move, the
model plugs into a training loop, and the CLI writes a loadable directory atomically,
refusing bad input with exit 2 and nothing on disk."""

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

import convert
from convert.cli import main

from conftest import TINY_LLAMA, hf_model

# Random tokens: with few training tokens the model memorises them and the held-out KL barely
# moves; 8k tokens in windows of 64 generalise (held-out KL 0.56 -> 0.40 on this fixture at a
# relative lr of 2e-2).
HEAL = {"steps": 100, "lr": 2e-2, "window": 64, "tokens": 8192, "check_every": 25, "progress": False, "device": "cpu"}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def healed():
    original = hf_model("llama")
    model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = convert.heal(model, _ids(8192, 1), original=original, eval_texts=_ids(256, 2), **HEAL)
    return model, before, result


@pytest.mark.slow
def test_heal_lowers_the_held_out_kl(healed):
    _, _, result = healed
    before, after = result.report["before"], result.report["after"]
    assert before["kl_mean"] > 1e-3  # compressed: there is something to heal
    assert after["kl_mean"] < 0.85 * before["kl_mean"], (before, after)
    assert after["ppl_original"] == before["ppl_original"]
    assert result.report["train_tokens"] == 8192 - 8192 // 16  # the last sixteenth is checked, not trained on
    assert result.report["checks"]["tokens"] == 8192 // 16 and result.report["eval_tokens"] == 256


@pytest.mark.slow
def test_heal_trains_only_the_mla_projections(healed):
    model, before, result = healed
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(".self_attn." in name for name in changed)
    assert result.report["trained_parameters"] == sum(
        p.numel() for name, p in model.named_parameters() if ".self_attn." in name
    )
    assert all(p.requires_grad for p in model.parameters())  # the flags are restored


@pytest.mark.slow
def test_a_model_healed_in_bf16_computes_as_its_weights_do_afterwards():
    """accelerate runs the student's forward under bf16 autocast; the healed module handed back has
    its own forward again (it kept the autocast: logits 1.3% off its own weights' in float32)."""
    original = hf_model("llama")
    model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
    convert.heal(model, _ids(2048, 1), original=original, **HEAL | {"steps": 2, "mixed_precision": "bf16"})
    fresh = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
    fresh.load_state_dict(model.state_dict())
    ids = _ids(64, 3)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, fresh.eval()(ids).logits)


def test_heal_needs_the_original_for_a_module():
    model = convert.to_mla(hf_model("llama"))
    with pytest.raises(convert.ConvertError, match="original="):
        convert.heal(model, _ids(64, 0), **HEAL)


@pytest.mark.slow
def test_checks_keep_a_diverging_heal_no_worse_than_the_unhealed_model():
    """At a rate far too high the KL blows up. The checks go back to the best weights at half the
    rate, so what is kept is the best model measured on the check tokens (the last sixteenth of
    the training ids), never one further from the original than the unhealed one."""
    from convert.healing import held_out_kl

    original, ids = hf_model("llama"), _ids(4096, 1)
    reports = {}
    for every in (0, 10):
        model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
        options = HEAL | {"steps": 40, "lr": 3.0, "check_every": every}
        reports[every] = convert.heal(model, ids, original=original, eval_texts=_ids(256, 2), **options).report
    unchecked, checked = reports[0], reports[10]
    assert unchecked["after"]["kl_mean"] > 1.3 * unchecked["before"]["kl_mean"]  # this rate overshoots
    checks = checked["checks"]
    assert [h["step"] for h in checks["history"]] == [0, 10, 20, 30, 40]
    assert checks["halvings"] >= 1 and checks["best_kl"] <= checks["history"][0]["kl"]
    assert checks["best_step"] == 0 and checked["after"] == checked["before"]  # nothing better: unhealed
    kept = held_out_kl(original, model, ids[:, -(4096 // 16) :], HEAL["window"])
    assert kept == pytest.approx(checks["best_kl"], rel=1e-5)  # the weights kept are the best checked


def test_a_text_too_short_for_the_check_tokens_is_refused_with_the_fix():
    original = hf_model("llama")
    model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
    options = HEAL | {"tokens": 64, "steps": 2}
    with pytest.raises(convert.ConvertError, match="too short to hold out check tokens.*check_every=0"):
        convert.heal(model, _ids(3, 1), original=original, eval_texts=_ids(64, 2), **options)
    result = convert.heal(model, _ids(3, 1), original=original, eval_texts=_ids(64, 2), **options | {"check_every": 0})
    assert result.report["checks"] is None and result.report["train_tokens"] == 3


def test_backtracking_goes_back_to_the_best_weights_at_half_the_rate():
    from convert.healing import Backtracking

    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([p], lr=1.0)
    kls = iter([1.0, 0.5, 0.7, 0.4])
    track = Backtracking({"p": p}, optimizer, lambda: next(kls))
    with torch.no_grad():
        p.fill_(1.0)
        track.check(1)  # better: kept
        p.fill_(2.0)
        optimizer.state[p]["exp_avg"] = torch.ones(3)
        track.check(2)  # worse: back to the step-1 weights, moments cleared, rate halved
        assert torch.equal(p, torch.ones(3)) and not optimizer.state and track.scale == 0.5
        p.fill_(3.0)
        track.check(3)
    report = track.report(tokens=8)
    assert (report["best_step"], report["best_kl"], report["halvings"]) == (3, 0.4, 1)
    assert [h["scale"] for h in report["history"]] == [1.0, 1.0, 1.0, 0.5]


# ------------------------------------------------------------------ the command line


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """A compressed conversion of the tiny Llama fixture (no report: --no-verify) and two texts."""
    root = tmp_path_factory.mktemp("heal")
    src = root / "src"
    shutil.copytree(TINY_LLAMA, src)
    out = root / "src-mla"
    convert.gqa2mla(src, out, kv_cache_ratio=0.5, method="svd", verify=False, progress=False)
    train = root / "train.txt"
    train.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)
    held = root / "held.txt"
    held.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition. " * 8)
    return src, out, train, held


def test_cli_heal_names_its_output_as_the_user_typed_it(compressed, tmp_path, monkeypatch):
    """From the working directory, as `gqa2mla` does: `wrote conv-healed`, not an absolute path."""
    src, converted, train, held = compressed
    shutil.copytree(converted, tmp_path / "conv")
    monkeypatch.chdir(tmp_path)
    result = _run("heal", "conv", "--text", train, "--original", src, "--steps", 2, "--window", 64, "--device", "cpu")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.startswith("wrote conv-healed\n"), result.stdout
    assert "; conv-healed/healing.md)" in result.stdout, result.stdout


@pytest.mark.slow
def test_cli_heal_writes_a_loadable_healed_directory(compressed, tmp_path):
    src, converted, train, held = compressed
    out = tmp_path / "healed"
    result = _run(
        "heal", converted, "--text", train, "--eval-text", held, "--original", src, "-o", out,
        "--steps", 20, "--lr", 2e-2, "--window", 64, "--device", "cpu", "--check-every", 5,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "healing.json").read_text())
    assert [h["step"] for h in report["checks"]["history"]] == [0, 5, 10, 15, 20]
    summary = f"kept the weights of step {report['checks']['best_step']} of 20, the best on"
    assert f"wrote {out}" in result.stdout and summary in result.stdout, result.stdout
    assert report["after"]["kl_mean"] < report["before"]["kl_mean"]
    assert "Healing report" in (out / "healing.md").read_text()
    assert "Checked every few steps" in (out / "healing.md").read_text() and report["checks"]["history"]
    assert json.loads((out / "config.json").read_text()) == json.loads((converted / "config.json").read_text())
    healed, unhealed = convert.load_mla_model(out), convert.load_mla_model(converted)
    moved = [n for n, t in healed.state_dict().items() if not torch.equal(t, unhealed.state_dict()[n])]
    assert moved and all(".self_attn." in n for n in moved)
    assert not any(".tmp-" in n for n in os.listdir(tmp_path))


def _heal_fails(tmp_path, *args, must_name=()):
    before = set(os.listdir(tmp_path))
    result = _run("heal", *args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for name in must_name:
        assert name in lines[0], lines[0]
    assert set(os.listdir(tmp_path)) == before
    return lines[0]


def test_cli_heal_refusals(compressed, tmp_path):
    src, converted, train, _ = compressed
    out = tmp_path / "healed"
    # no --original and no report naming it
    _heal_fails(tmp_path, converted, "--text", train, "-o", out, must_name=["--original"])
    # not a converted directory
    _heal_fails(tmp_path, src, "--text", train, "--original", src, "-o", out, must_name=["mla"])
    # bad option values
    _heal_fails(tmp_path, converted, "--text", train, "--original", src, "-o", out, "--steps", 0, must_name=["--steps"])
    _heal_fails(
        tmp_path, converted, "--text", train, "--original", src, "-o", out, "--check-every", -1,
        must_name=["--check-every"],
    )  # fmt: skip
    _heal_fails(
        tmp_path, converted, "--text", tmp_path / "none.txt", "--original", src, "-o", out, must_name=["none.txt"]
    )
    # an existing directory convert did not write is never replaced, even with --force
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    result = _run("heal", converted, "--text", train, "--original", src, "-o", foreign, "--force", "-q")
    assert result.exit_code == 2 and (foreign / "keep.txt").read_text() == "mine"


def test_unset_sizes_are_the_devices_and_given_ones_kept():
    from convert.options import HEAL_SIZES, HealOptions

    cpu = HealOptions(device="cpu").sized()
    assert {k: getattr(cpu, k) for k in HEAL_SIZES["cpu"]} == HEAL_SIZES["cpu"]
    given = HealOptions(device="cpu", steps=7, check_every=0, window=16).sized()  # 0 (no checks) is a value
    assert (given.steps, given.check_every, given.window) == (7, 0, 16)
    assert given.tokens == HEAL_SIZES["cpu"]["tokens"]
    for sizes in HEAL_SIZES.values():  # each device checks eight times in a run of its default steps
        assert sizes["steps"] // sizes["check_every"] == 8


@pytest.mark.slow
def test_heal_finds_the_original_from_the_report(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(TINY_LLAMA, src)
    convert.gqa2mla(src, tmp_path / "mla", progress=False)  # exact, verified: the report names src
    text = tmp_path / "t.txt"
    text.write_text("a short text to heal on, twice over. " * 20)
    result = convert.heal(tmp_path / "mla", text, output=tmp_path / "healed", steps=2, lr=1e-5, **{
        k: v for k, v in HEAL.items() if k not in ("steps", "lr", "tokens")
    })  # fmt: skip
    assert result.report["inputs"]["original"] == str(src)
    assert result.report["before"]["kl_mean"] < 1e-8  # exact conversion: nothing to heal
    assert (result.output / "healing.json").is_file()


def test_heal_of_a_module_wants_token_ids(tmp_path):
    original = hf_model("llama")
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    with pytest.raises(convert.ConvertError, match="token ids"):
        convert.heal(convert.to_mla(original), text, original=original, **HEAL)


# ------------------------------------------------------------------ export targets


@pytest.mark.slow
@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_heal_an_export_through_its_transformers_twin(tmp_path, target):
    """A DeepSeek-V3 export is healed as transformers runs it (the vllm one with vLLM's latent-norm
    eps, its residual stream scaled ~1e8) and written under its own names: only attention tensors
    move, the latent norm's pass-through (norm weights, the constant bias row) stays, and what loads
    from disk is what was trained. On random weights the vllm export's own loss is not learnable
    (KL 0.008 stays), so the export's queries and kv_b_proj are perturbed into a gap healing can close."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from convert.targets.vllm import match_vllm_norms

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=64, num_hidden_layers=2,
        vocab_size=128, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=256,
        initializer_range=0.06,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "src")
    out = tmp_path / "export"
    calib = _ids(256, 3) if target == "vllm" else None
    convert.gqa2mla(tmp_path / "src", out, target=target, calib=calib, verify=False, progress=False)
    unhealed = load_file(out / "model.safetensors")
    noise = torch.Generator().manual_seed(9)
    for name in [n for n in unhealed if ".self_attn.q_proj." in n or ".kv_b_proj." in n]:
        unhealed[name] = unhealed[name] * (1 + 0.3 * torch.randn(unhealed[name].shape, generator=noise))
    save_file(unhealed, out / "model.safetensors", metadata={"format": "pt"})
    result = convert.heal(
        out,
        _ids(8192, 1),
        original=tmp_path / "src",
        eval_texts=_ids(256, 2),
        output=tmp_path / "healed",
        **HEAL | {"lr": 3e-3},
    )
    before, after = result.report["before"], result.report["after"]
    assert after["kl_mean"] < 0.75 * before["kl_mean"], (before, after)
    healed = load_file(result.output / "model.safetensors")
    assert healed.keys() == unhealed.keys()
    moved = {name for name in healed if not torch.equal(healed[name], unhealed[name])}
    frozen = ("_layernorm.", "kv_a_proj_with_mqa.bias")  # the latent norm's pass-through
    assert moved and all(".self_attn." in name and not any(f in name for f in frozen) for name in moved), moved
    assert target != "vllm" or not any(name.endswith(".bias") for name in moved)  # vLLM would skip them
    assert json.loads((result.output / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(result.output, dtype=torch.float32).eval()
    if target == "vllm":
        match_vllm_norms(reloaded)
    x = _ids(48, 4)
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, result.model.eval()(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_heal_a_live_vllm_twin_from_to_mla():
    """`to_mla(model, target="vllm")` is the export's transformers twin in memory: healing it in a
    pipeline moves its attention tensors only, never the latent norm's pass-through."""
    from tiny_models import tiny_llama

    original = tiny_llama(3)
    twin = convert.to_mla(original, target="vllm", calib=_ids(256, 3))
    before = {name: p.detach().clone() for name, p in twin.named_parameters()}
    options = HEAL | {"steps": 5, "check_every": 0}  # what moves, unchecked (5 steps may not beat the start)
    result = convert.heal(twin, _ids(1024, 1), original=original, eval_texts=_ids(128, 2), **options)
    assert result.model is twin and result.report["steps"] == 5
    moved = {name for name, p in twin.named_parameters() if not torch.equal(p, before[name])}
    frozen = ("_layernorm.", ".bias")  # the latent norm's pass-through; vLLM skips attention biases
    assert moved and all(".self_attn." in name and not any(f in name for f in frozen) for name in moved), moved


def test_the_report_warns_when_healing_moves_away_from_the_original():
    """Perplexity can fall while the KL to the original rises (SmolLM2 at 75% of the cache, at the
    rate of 1e-3 without checks: ×1.019 -> ×0.981, KL 0.026 -> 0.043): say so, as when perplexity
    gets worse, and name the checks when they were off."""
    from convert.healing import healing_warnings, render_markdown

    def report(ppl_ratio: float, kl: float) -> dict:
        figures = {"ppl_converted": 30 * ppl_ratio, "ppl_ratio": ppl_ratio, "kl_mean": kl, "top1_agreement": 0.9}
        return figures | {"ppl_original": 30.0}

    base = {"steps": 1, "lr": 1e-3, "window": 8, "train_tokens": 8, "trained_parameters": 1, "seconds": 1.0}
    base |= {"device": "cpu", "eval_tokens": 8}
    healed = base | {"before": report(1.019, 0.026), "after": report(0.98, 0.020)}
    assert healing_warnings(healed) == []
    styled = base | {"before": report(1.019, 0.026), "after": report(0.981, 0.043)}
    (warning,) = healing_warnings(styled)
    assert "away from the original" in warning and "0.026 -> 0.043" in warning and "--check-every" in warning
    (checked,) = healing_warnings(styled | {"checks": {"best_step": 3}})
    assert "away from the original" in checked and "--check-every" not in checked
    assert warning in render_markdown(styled)
    worse = base | {"before": report(1.019, 0.026), "after": report(1.2, 0.1)}
    assert len(healing_warnings(worse)) == 2


@pytest.mark.slow
def test_gradient_checkpointing_and_micro_batches_change_memory_not_the_result():
    """Recomputing activations gives the same gradients; 2 micro-batches of 1 window accumulated
    train as one batch of 2 (the same windows: the order depends on the global batch only)."""
    original = hf_model("llama")
    reports = []
    for extra in ({"batch_size": 2}, {"grad_accum": 2}, {"grad_accum": 2, "gradient_checkpointing": True}):
        model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")
        options = HEAL | {"steps": 4, "check_every": 0, "tokens": 1024} | extra
        reports.append(convert.heal(model, _ids(1024, 1), original=original, eval_texts=_ids(128, 2), **options).report)
        assert not model.model.layers[0].gradient_checkpointing  # switched off again after healing
    kls = [[h["kl"] for h in report["history"]] for report in reports]
    assert kls[1] == pytest.approx(kls[0], rel=1e-5) and kls[2] == pytest.approx(kls[1], rel=1e-6)
    assert reports[2]["after"]["kl_mean"] == pytest.approx(reports[0]["after"]["kl_mean"], rel=1e-5)
    assert reports[0]["after"]["kl_mean"] < reports[0]["before"]["kl_mean"]
