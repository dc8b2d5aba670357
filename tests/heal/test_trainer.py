"""Healing as a piece of the user's own loop: `DistillationTrainer` (transformers' `Trainer` with
the healing objective), `HealingCallback` (the checks) and `HealingWindows` (the data in `convert
heal`'s order) heal a converted model as `convert.heal` does with the same data, steps and seed:
the same per-step KL, the same checks, the same weights."""

import pytest
import torch
import transformers

import convert
from convert.healing import (
    distillation_loss,
    healing_optimizer,
    healing_scheduler,
    trainable_parameters,
    warmup_cosine,
)
from convert.healing.train import hold_out
from convert.healing.trainer import DistillationTrainer, HealingCallback, HealingWindows
from convert.options import HEAL_SIZES

from conftest import hf_model

STEPS, WINDOW, BATCH, ACCUM, LR, EVERY, SEED = 12, 32, 2, 2, 2e-2, 5, 7


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _student(original):
    return convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, method="svd")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same compressed model healed by `convert.heal` and by `DistillationTrainer`."""
    original = hf_model("llama")
    ids, eval_ids = _ids(4096, 1), _ids(256, 2)
    ours = _student(original)
    options = dict(steps=STEPS, lr=LR, window=WINDOW, batch_size=BATCH, grad_accum=ACCUM, check_every=EVERY)
    result = convert.heal(ours, ids, original=original, eval_texts=eval_ids, seed=SEED, progress=False, **options)

    theirs = _student(original)
    train_ids, check_ids = hold_out(ids, 16, "check tokens", "")  # as convert heal holds them out
    checks = HealingCallback(original, check_ids, every=EVERY, window=WINDOW)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("trainer")),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=SEED,
        disable_tqdm=True,
    )
    data = HealingWindows(train_ids, WINDOW, STEPS * BATCH * ACCUM, seed=SEED)
    trainer = DistillationTrainer(model=theirs, args=args, train_dataset=data, teacher=original, checks=checks)
    trainer.train()
    return ours, result.report, theirs, trainer, checks


@pytest.mark.slow
def test_the_trainer_heals_as_convert_heal_does(both):
    ours, report, theirs, trainer, checks = both
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    expected = [entry["kl"] for entry in report["history"]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6)
    mine_checks, their_checks = report["checks"]["history"], checks.report()["history"]
    assert [(c["step"], c["scale"]) for c in their_checks] == [(c["step"], c["scale"]) for c in mine_checks]
    assert [c["kl"] for c in their_checks] == pytest.approx([c["kl"] for c in mine_checks], rel=1e-4)
    mine, yours = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for name in trainable_parameters(ours):
        torch.testing.assert_close(yours[name], mine[name], rtol=1e-4, atol=1e-6)
    assert report["after"]["kl_mean"] < report["before"]["kl_mean"]  # and it healed


@pytest.mark.slow
def test_the_trainer_trains_only_the_mla_projections(both):
    _, _, theirs, _, _ = both
    original = hf_model("llama")
    for name, p in theirs.named_parameters():
        if ".self_attn." not in name:
            torch.testing.assert_close(p, original.state_dict()[name], rtol=0, atol=0)


def test_the_checks_go_back_when_a_step_makes_the_model_worse():
    """A callback whose check finds a worse KL puts the best weights back and halves the rate."""
    original = hf_model("llama")
    student = _student(original)
    optimizer = healing_optimizer(student, 1e-3)
    checks = HealingCallback(original, _ids(128, 3), every=1, window=WINDOW)
    scheduler = healing_scheduler(optimizer, 10, checks)
    checks.start(student, optimizer, scheduler)
    name, p = next(iter(trainable_parameters(student).items()))
    best = p.detach().clone()
    with torch.no_grad():
        p.add_(torch.randn_like(p))  # a step that makes it far worse
    state = transformers.TrainerState(global_step=1, max_steps=10)
    checks.on_step_end(None, state, transformers.TrainerControl())
    assert torch.equal(p, best) and checks.scale == 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.base_lrs[0] * 0.5 * warmup_cosine(0, 10))


def test_unset_check_sizes_are_convert_heals_for_the_device():
    """`every` and `window` left unset are what `convert heal` checks with on the model's device
    (its CPU sizes here); given ones are kept; a zero is refused, not a check at every step."""
    original = hf_model("llama")
    student = _student(original)
    optimizer = healing_optimizer(student, 1e-3)
    unset, given = HealingCallback(original, _ids(128, 3)), HealingCallback(original, _ids(128, 3), every=3, window=16)
    for checks in (unset, given):
        checks.start(student, optimizer, healing_scheduler(optimizer, 10, checks))
    assert (unset.every, unset.window) == (HEAL_SIZES["cpu"]["check_every"], HEAL_SIZES["cpu"]["window"])
    assert (given.every, given.window) == (3, 16)
    with pytest.raises(convert.ConvertError, match="every=0"):
        HealingCallback(original, _ids(128, 3), every=0)


def test_the_loss_leaves_padding_out():
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    whole = distillation_loss(student, teacher)
    masked = distillation_loss(student, teacher, mask)
    kept = torch.cat([student[0, 2:], student[1]])[None], torch.cat([teacher[0, 2:], teacher[1]])[None]
    torch.testing.assert_close(masked, distillation_loss(*kept))
    assert not torch.isclose(masked, whole)


def test_the_trainer_needs_the_teacher(tmp_path):
    original = hf_model("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(convert.ConvertError, match="teacher"):
        DistillationTrainer(model=_student(original), args=args, train_dataset=HealingWindows(_ids(256, 1), 32, 4))
