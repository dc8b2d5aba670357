"""The healing objective as pieces a training loop of one's own can use: the trainable set (the MLA
projections), the loss (KL of the next-token distributions to the original's), the optimizer (AdamW
at per-tensor relative rates), the schedule, and the held-out checks that keep the best weights."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR

from convert.errors import ConvertError
from convert.optim import relative_groups, warmup_cosine
from convert.text import scored_windows

#: Export tensors that hold the pass-through of DeepseekV3's latent norm (`convert.targets`): the norm
#: weights and the transformers target's constant bias row M. Never trained: a relative learning
#: rate would move their zero entries by ~1e-3·M.
_PASS_THROUGH = ("_layernorm.", "kv_a_proj_with_mqa.bias")


class RateScale(Protocol):
    """What scales the healing rate (`healing_scheduler`): a `Backtracking`, or a `HealingCallback` following one."""

    @property
    def scale(self) -> float: ...


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The MLA projections: every parameter of an attention module (`*.self_attn.*`) but a
    DeepSeek-V3 export's latent-norm pass-through (`_PASS_THROUGH`) and what the export's runtime
    never reads (the model's `untrained_parameters`, name endings: a vllm export's attention biases)."""
    skipped = tuple(getattr(model, "untrained_parameters", ()))
    found = {
        name: p
        for name, p in model.named_parameters()
        if ".self_attn." in name and not any(part in name for part in _PASS_THROUGH) and not name.endswith(skipped)
    }
    if not found:
        raise ConvertError("the model has no `.self_attn.` parameters to heal; pass a converted MLA model")
    return found


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask=None) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student) of the next-token distributions, in float32.

    student_logits, teacher_logits: (B, L, V). mask: optional (B, L), nonzero where a token counts
    (a batch's attention mask: padding left out of the mean)."""
    log_student = torch.log_softmax(student_logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(-1)  # (B, L)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def healing_optimizer(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.AdamW:
    """The optimizer of healing: AdamW (no weight decay) over `trainable_parameters(model)`, one group
    per tensor at its `relative_rates` rate; every other parameter of `model` is frozen
    (`requires_grad` off), so a `Trainer` or a loop of one's own trains just these."""
    trainable = trainable_parameters(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    return torch.optim.AdamW(relative_groups(trainable.values(), lr), weight_decay=0.0)


def healing_scheduler(optimizer, steps: int, checks: RateScale | None = None) -> LambdaLR:
    """The rate of healing: `warmup_cosine` over `steps` optimizer steps, times the checks' scale
    (halved each time a check goes back to the best weights)."""
    return LambdaLR(optimizer, lambda step: (checks.scale if checks else 1.0) * warmup_cosine(step, steps))


def schedule_at(scheduler: LambdaLR, step: int) -> None:
    """Set `scheduler` to `step` and its optimizer's rates with it (a resumed run's first step; a
    check's new scale)."""
    scheduler.last_epoch = step
    for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * rate(step)


@torch.no_grad()
def held_out_kl(original, model, ids: torch.Tensor, window: int) -> float:
    """KL(original ‖ model) per token on `ids` (1, N), in windows of `window` tokens (eval mode)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in scored_windows(ids, window):  # (1, ≤window)
        n = chunk.shape[-1]
        total += float(distillation_loss(model(chunk).logits, original(chunk).logits)) * n
        count += n
    model.train(was_training)
    return total / count


class Backtracking:
    """Keeps healing from moving a model away from the original: a held-out KL (`measure`) is
    checked every few steps; a better one keeps a copy of the trained tensors, a worse one puts
    the best copy back, clears AdamW's moments and halves the rate (`scale`). One rate does
    not suit every gap: a relative 1e-3 heals SmolLM2 at 25% of the cache but overshoots at
    75%, where the checks bring the held-out KL back down (docs/compression.md, "Healing")."""

    def __init__(self, trainable: dict[str, torch.nn.Parameter], optimizer, measure) -> None:
        self.trainable, self.optimizer, self.measure = trainable, optimizer, measure
        # a `healing_scheduler` reading `scale`: its rates are renewed at a halving
        self.scheduler: LambdaLR | None = None
        self.scale, self.halvings = 1.0, 0
        self.best_kl = measure()
        self.best_step = 0
        self.history = [{"step": 0, "kl": self.best_kl, "scale": 1.0}]
        self._best = self._copy()

    def _copy(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.trainable.items()}

    def check(self, step: int) -> None:
        """Measure at `step`: keep the weights if better, else go back to the best at half the rate."""
        kl = self.measure()
        self.history.append({"step": step, "kl": kl, "scale": self.scale})
        if kl < self.best_kl:
            self.best_kl, self.best_step, self._best = kl, step, self._copy()
            return
        self.restore_best()
        self.optimizer.state.clear()
        self.scale /= 2
        self.halvings += 1
        if self.scheduler is not None:  # the next step's rates, at the new scale
            schedule_at(self.scheduler, self.scheduler.last_epoch)

    @torch.no_grad()
    def restore_best(self) -> None:
        """Put the best weights measured back into the model."""
        for name, p in self.trainable.items():
            p.copy_(self._best[name])

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the checks: the best weights and the figures."""
        keep = ("scale", "halvings", "best_kl", "best_step", "history")
        return {"best": self._best, **{k: getattr(self, k) for k in keep}}

    def load_state_dict(self, state: dict) -> None:
        self._best = {name: t.to(self.trainable[name].device) for name, t in state["best"].items()}
        for key in ("scale", "halvings", "best_kl", "best_step", "history"):
            setattr(self, key, state[key])

    def report(self, tokens: int) -> dict:
        """The checks for the healing report."""
        return {
            "tokens": tokens,
            "best_step": self.best_step,
            "best_kl": self.best_kl,
            "halvings": self.halvings,
            "history": self.history,
        }
