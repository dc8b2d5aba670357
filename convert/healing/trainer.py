"""Healing inside transformers' `Trainer`: the distillation loss as `compute_loss`, the healing
optimizer and schedule as the Trainer's, the held-out checks as a callback, and the windows of
`convert heal` as a dataset in its order. The same objective as `convert heal` (`objective.py`)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainerCallback

from convert.errors import ConvertError
from convert.healing.data import WindowsInMemory
from convert.healing.objective import Backtracking, distillation_loss, healing_optimizer, healing_scheduler, held_out_kl
from convert.options import heal_sizes


class HealingWindows(Dataset):
    """The training windows of `convert heal` as a dataset, in its order: item k is sample k of the
    run (windows of `window` tokens of `ids` (1, N), a seeded permutation per epoch), so a `Trainer`
    taking them in order (`DistillationTrainer` does) sees the same batches, `length` items in all."""

    def __init__(self, ids: torch.Tensor, window: int, length: int, seed: int = 0) -> None:
        self.windows, self.length = WindowsInMemory(ids.reshape(1, -1), window, seed), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows.batch(range(k, k + 1))[0]}  # (window,)


class HealingCallback(TrainerCallback):
    """The checks of `convert heal` in a `Trainer`: every `every` optimizer steps (and at the last)
    the KL to `teacher` on `check_ids` (1, N) in windows of `window` tokens, never trained on; a
    better one keeps the weights, a worse one goes back to the best at half the rate (`Backtracking`).
    `every` and `window` left unset are `convert heal`'s for the device the model trains on
    (`HEAL_SIZES`: CPU every 125 steps in 256-token windows, CUDA every 250 in 1,024). Pass the same
    instance to `DistillationTrainer(checks=...)`, whose schedule reads the rate's scale."""

    def __init__(self, teacher, check_ids: torch.Tensor, every: int | None = None, window: int | None = None) -> None:
        for name, value in (("every", every), ("window", window)):
            if value is not None and value < 1:
                raise ConvertError(f"HealingCallback({name}={value}): give a positive number of steps/tokens or None")
        self.teacher, self.check_ids, self.every, self.window = teacher, check_ids, every, window
        self.backtracking: Backtracking | None = None

    @property
    def scale(self) -> float:
        return self.backtracking.scale if self.backtracking else 1.0

    def start(self, model, optimizer, scheduler) -> None:
        """Measure the unhealed model (the first best) and follow `optimizer` and `scheduler`."""
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        device = next(iter(trainable.values())).device
        sizes = heal_sizes(device)
        self.every = self.every if self.every is not None else sizes["check_every"]
        self.window = self.window if self.window is not None else sizes["window"]
        ids = self.check_ids.to(device)
        self.backtracking = Backtracking(
            trainable, optimizer, lambda: held_out_kl(self.teacher, model, ids, self.window)
        )
        self.backtracking.scheduler = scheduler

    def on_step_end(self, args, state, control, **kwargs):
        if self.backtracking is not None and (
            state.global_step % self.every == 0 or state.global_step == state.max_steps
        ):
            self.backtracking.check(state.global_step)
        return control

    def report(self) -> dict | None:
        """The checks' figures (as `convert heal`'s report gives them)."""
        return None if self.backtracking is None else self.backtracking.report(int(self.check_ids.shape[-1]))


class DistillationTrainer(Trainer):
    """A `Trainer` that heals a converted model toward `teacher` (the original, frozen): the loss is
    KL(teacher ‖ model) of the next-token distributions (padding left out where the batch has an
    attention mask), only the MLA projections train, each tensor at `lr` × its RMS (`args.
    learning_rate`, warmed up over 10 steps then a cosine to 0 over `args.max_steps`), with the
    held-out `checks` (a `HealingCallback`) when given. Everything else is the `Trainer`'s own:
    data, collator, accumulation, precision, checkpoints, trackers. A dataset of `HealingWindows`
    is taken in order, as `convert heal` takes it."""

    def __init__(self, *args, teacher=None, checks: HealingCallback | None = None, **kwargs) -> None:
        if teacher is None:
            raise ConvertError(
                "DistillationTrainer(teacher=...): pass the original model the student was converted from"
            )
        callbacks = list(kwargs.pop("callbacks", None) or []) + ([checks] if checks is not None else [])
        # transformers' Trainer also takes `callbacks` positionally: mypy cannot tell that `*args` stops short of it
        super().__init__(*args, callbacks=callbacks, **kwargs)  # type: ignore[misc]  # transformers' Trainer signature
        self.teacher, self.checks = teacher.requires_grad_(False).eval(), checks
        self.loss_is_scaled_for_ga = False  # a mean per micro-batch: the Trainer divides by the accumulation

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = healing_optimizer(model if model is not None else self.model, self.args.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = healing_scheduler(optimizer, num_training_steps, self.checks)
            if self.checks is not None:
                self.checks.start(self.model, optimizer, self.lr_scheduler)
        return self.lr_scheduler

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if isinstance(dataset, HealingWindows):
            return SequentialSampler(dataset)
        return super()._get_train_sampler(train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {k: v for k, v in inputs.items() if k != "labels"}  # the teacher is the target
        self.teacher.to(inputs["input_ids"].device)
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits  # (B, L, V)
        outputs = model(**inputs)
        loss = distillation_loss(outputs.logits, teacher_logits, inputs.get("attention_mask"))
        return (loss, outputs) if return_outputs else loss
