"""Healing: a short distillation of a converted model toward the original's logits.

The converted model's MLA projections (and only they: every other parameter stays frozen) are
trained to minimise KL(original ‖ converted) of the next-token distributions on a calibration
text, window by window; before/after perplexity and KL are measured on held-out tokens.
`heal(model_or_path, texts, original=..., **options)` works on a live module (healed in place,
e.g. the output of `convert.to_mla`) or on a converted directory (loaded, healed and written to a
new directory atomically, like a conversion), a DeepSeek-V3 export included (trained as
transformers runs it, written under its own names).
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import ConvertError
from convert.hf import load_original
from convert.io import SAFETENSORS_DTYPES, CheckpointWriter, open_checkpoint, output_lock, parse_size
from convert.mla.model import load_mla_model, read_mla_config, weight_files
from convert.options import HealOptions
from convert.progress import progress
from convert.text import text_token_ids
from convert.verify import is_export, load_export
from convert.verify.e2e import compare_models

# Files of a converted directory that are not carried into a healed one: the weights
# (rewritten), convert's own bookkeeping, and the conversion's report (it describes the
# weights before healing; the healed directory's report is healing.json/.md).
_NOT_CARRIED = {
    "model.safetensors.index.json",
    ".convert-manifest.json",
    "verification.json",
    "verification.md",
    "verification.png",
    "healing.json",
    "healing.md",
}


@dataclass
class HealResult:
    """What `heal` did: the healed model and the figures of its report (`report`)."""

    model: torch.nn.Module
    report: dict
    output: Path | None = None


#: Export tensors that hold the pass-through of DeepseekV3's latent norm (`convert.targets`): the norm
#: weights and the transformers target's constant bias row M. Never trained: a relative learning
#: rate would move their zero entries by ~1e-3·M.
_PASS_THROUGH = ("_layernorm.", "kv_a_proj_with_mqa.bias")


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The MLA projections: every parameter of an attention module (`*.self_attn.*`) but a
    DeepSeek-V3 export's latent-norm pass-through (`_PASS_THROUGH`)."""
    found = {
        name: p
        for name, p in model.named_parameters()
        if ".self_attn." in name and not any(part in name for part in _PASS_THROUGH)
    }
    if not found:
        raise ConvertError("the model has no `.self_attn.` parameters to heal; pass a converted MLA model")
    return found


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student), computed in float32 (logits (B, L, V))."""
    log_student = torch.log_softmax(student_logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (log_teacher.exp() * (log_teacher - log_student)).sum(-1).mean()


def relative_groups(parameters, lr: float) -> list[dict]:
    """One AdamW group per tensor with learning rate lr × the tensor's RMS (an all-zero tensor,
    e.g. a bias the conversion left at 0, takes the median RMS of the others): Adam moves every
    entry by about its learning rate whatever the gradient's scale, so an absolute rate would move
    a tensor of small entries far more, relatively, than one of large entries (a vllm export's
    o_proj is ~1e8, its kv_b_proj ~0.03)."""
    parameters = list(parameters)
    rms = [float(p.detach().float().pow(2).mean().sqrt()) for p in parameters]
    nonzero = sorted(r for r in rms if r > 0)
    fallback = nonzero[len(nonzero) // 2] if nonzero else 1.0
    return [{"params": [p], "lr": lr * (r if r > 0 else fallback)} for p, r in zip(parameters, rms)]


def warmup_cosine(step: int, steps: int, warmup: int = 10) -> float:
    """The learning rate's factor at `step`: linear warmup over `warmup` steps, then a cosine to 0."""
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def _windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Non-overlapping windows (1, ≤window) of `ids` (1, N); a last window of one token is dropped."""
    return [ids[:, s : s + window] for s in range(0, ids.shape[-1], window) if ids[:, s : s + window].shape[-1] > 1]


def _measure(original, model, ids: torch.Tensor, window: int) -> dict:
    was_training = model.training
    model.eval()
    figures = compare_models(original, model, ids, window=window)
    model.train(was_training)
    keys = ("ppl_original", "ppl_converted", "ppl_ratio", "kl_mean", "top1_agreement")
    return {key: figures[key] for key in keys}


def heal_model(model, original, train_ids: torch.Tensor, eval_ids: torch.Tensor, opts: HealOptions) -> dict:
    """Distil `model` toward `original` on `train_ids` (1, N) in place; figures on `eval_ids`.

    Only `trainable_parameters(model)` change (AdamW, gradients clipped to norm 1; each
    tensor's learning rate `opts.lr` times its RMS, `relative_groups`, warmed up over 10 steps
    and decayed to 0 on a cosine); every parameter's `requires_grad` is restored afterwards.
    With `opts.check_every`, the last sixteenth of `train_ids` is not trained on but checked
    (`Backtracking`): the model returned is the best one there, the unhealed one included.
    """
    device = next(model.parameters()).device
    train_ids, eval_ids = train_ids.to(device), eval_ids.to(device)
    check_ids = None
    if opts.check_every:
        train_ids, check_ids = _hold_out(train_ids, 16, "check tokens", "pass --check-every 0")
    windows = _windows(train_ids, opts.window)
    if not windows:
        raise ConvertError("--text: fewer than 2 training tokens; give a longer text")
    before = _measure(original, model, eval_ids, opts.eval_window)
    trainable = trainable_parameters(model)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    original.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    optimizer = torch.optim.AdamW(relative_groups(trainable.values(), opts.lr), weight_decay=0.0)
    track = None
    if check_ids is not None:
        track = Backtracking(trainable, optimizer, lambda: held_out_kl(original, model, check_ids, opts.window))
    base_rates = [group["lr"] for group in optimizer.param_groups]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(opts.seed))
    losses, tokens, start = [], 0, time.perf_counter()
    was_training = model.training
    model.train()
    try:
        bar = progress(range(opts.steps), "healing", "step", opts.progress)
        for step in bar:
            chunk = windows[int(order[step % len(windows)])]  # (1, ≤window)
            with torch.no_grad():
                teacher = original(chunk).logits
            loss = distillation_loss(model(chunk).logits, teacher)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
            factor = (track.scale if track else 1.0) * warmup_cosine(step, opts.steps)
            for group, rate in zip(optimizer.param_groups, base_rates):
                group["lr"] = rate * factor
            optimizer.step()
            losses.append(loss.item())
            if track and ((step + 1) % opts.check_every == 0 or step + 1 == opts.steps):
                track.check(step + 1)  # the last step is checked too: the model ends at the best weights
            tokens += chunk.shape[-1]
            rate = tokens / (time.perf_counter() - start)
            bar.set_postfix({"kl": f"{losses[-1]:.4f}", "tokens/s": f"{rate:.0f}"})
    finally:
        model.train(was_training)
        for name, p in model.named_parameters():
            p.requires_grad_(flags[name])
    after = _measure(original, model, eval_ids, opts.eval_window)
    return {
        "steps": opts.steps,
        "lr": opts.lr,
        "window": opts.window,
        "eval_window": opts.eval_window,
        "seed": opts.seed,
        "train_tokens": int(train_ids.shape[-1]),
        "eval_tokens": int(eval_ids.shape[-1]),
        "trained_parameters": sum(p.numel() for p in trainable.values()),
        "train_kl_first": losses[0] if losses else None,
        "train_kl_last": losses[-1] if losses else None,
        "checks": track.report(int(check_ids.shape[-1])) if track else None,
        "seconds": time.perf_counter() - start,
        "device": str(device),
        "before": before,
        "after": after,
    }


@torch.no_grad()
def held_out_kl(original, model, ids: torch.Tensor, window: int) -> float:
    """KL(original ‖ model) per token on `ids` (1, N), in windows of `window` tokens (eval mode)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in _windows(ids, window):  # (1, ≤window)
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
    75%, where the checks bring the held-out KL back down (docs/compression.md, "Healing";
    bench/heal.py measures it)."""

    def __init__(self, trainable: dict[str, torch.nn.Parameter], optimizer, measure) -> None:
        self.trainable, self.optimizer, self.measure = trainable, optimizer, measure
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

    @torch.no_grad()
    def restore_best(self) -> None:
        """Put the best weights measured back into the model."""
        for name, p in self.trainable.items():
            p.copy_(self._best[name])

    def report(self, tokens: int) -> dict:
        """The checks for the healing report."""
        return {
            "tokens": tokens,
            "best_step": self.best_step,
            "best_kl": self.best_kl,
            "halvings": self.halvings,
            "history": self.history,
        }


def _hold_out(ids: torch.Tensor, part: int, what: str, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` (1, N) split into its first tokens and its last 1/`part`, `what` (at least 2 tokens each)."""
    n_out = max(2, ids.shape[-1] // part)
    if ids.shape[-1] - n_out < 2:
        raise ConvertError(f"--text is too short to hold out {what}: give a longer text or {fix}")
    return ids[:, :-n_out], ids[:, -n_out:]


def _split(ids: torch.Tensor, eval_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out tokens: `eval_ids` when given, else the last eighth of `ids`."""
    if eval_ids is not None:
        return ids, eval_ids
    return _hold_out(ids, 8, "evaluation tokens", "pass --eval-text")


def _token_ids(texts, root: Path | None, vocab_size: int, n_tokens: int, what: str) -> torch.Tensor:
    """Token ids (1, N) from ids, or from text files (concatenated) tokenized with the tokenizer of
    the model directory `root` (None: a live module, whose tokenizer is not known here)."""
    if isinstance(texts, torch.Tensor):
        return texts.reshape(1, -1)[:, :n_tokens]
    if root is None:
        raise ConvertError(
            f"heal(model, {what}=...): a live model's tokenizer is not known here; pass token ids (1, N) from "
            "the model's tokenizer (text files are for a converted directory)"
        )
    paths = [texts] if isinstance(texts, (str, Path)) else list(texts)
    parts = [text_token_ids(Path(p), root, vocab_size, n_tokens, what) for p in paths]
    return torch.cat(parts, dim=-1)[:, :n_tokens]


def _original_of(converted: Path, given) -> Path:
    """The original checkpoint: `--original`, else the one the conversion's report names."""
    if given is not None:
        return Path(given)
    report = converted / "verification.json"
    if report.is_file():
        path = json.loads(report.read_text()).get("inputs", {}).get("original", {}).get("path")
        if path and Path(path).exists():
            return Path(path)
    raise ConvertError(
        f"{converted}: no --original given and no verification.json naming an existing original checkpoint; "
        "pass --original PATH (the GQA checkpoint it was converted from)"
    )


def heal(model_or_path, texts, *, original=None, eval_texts=None, output=None, **options) -> HealResult:
    """Distil a converted model toward the original's logits (KL on `texts`).

    model_or_path: a converted MLA model (an nn.Module, e.g. from `convert.to_mla`;
    healed in place) or a directory written by `convert gqa2mla` (loaded, healed and
    written to `output`, default `<dir>-healed`, atomically; `force=True` replaces
    only a directory convert wrote), an export (`--target transformers/vllm`) included:
    it is healed as its transformers twin (`convert.verify.load_export`) and written under
    its own tensor names, so vLLM serves the healed weights as it served the export.
    texts: token ids (1, N); for a directory also a UTF-8 text file, or several, tokenized
    with its tokenizer. original: the original model (nn.Module) or its checkpoint path; for
    a directory, default the one its verification.json names. eval_texts: held-out text
    (default: the last eighth of `texts`). options: the fields of `HealOptions` (steps, lr,
    window, tokens, device, seed, ...). Returns a `HealResult` whose
    `report` has the before/after perplexity and KL on the held-out tokens.
    """
    opts = HealOptions.from_kwargs(**options)
    if isinstance(model_or_path, torch.nn.Module):
        if original is None:
            raise ConvertError("heal(model, ...): pass original= (the model it was converted from)")
        if output is not None:
            raise ConvertError("heal(model, ...) heals the module in place; output= is for a converted directory")
        orig_model = original if isinstance(original, torch.nn.Module) else _load_original(original, model_or_path)
        vocab = model_or_path.config.vocab_size
        ids = _token_ids(texts, None, vocab, opts.tokens, "texts")
        eval_ids = None if eval_texts is None else _token_ids(eval_texts, None, vocab, opts.tokens, "eval_texts")
        report = heal_model(model_or_path, orig_model, *_split(ids, eval_ids), opts)
        return HealResult(model_or_path, report)
    return _heal_directory(Path(model_or_path), texts, original, eval_texts, output, opts)


def _load_original(path, like: torch.nn.Module):
    parameter = next(like.parameters())
    with open_checkpoint(Path(path)) as source:
        return load_original(source, source.config or {}, parameter.device, parameter.dtype)


def default_healed_output(converted: Path) -> Path:
    """`<dir>-healed` beside the converted directory."""
    return converted.resolve().parent / f"{converted.name}-healed"


def _heal_directory(converted: Path, texts, original, eval_texts, output, opts: HealOptions) -> HealResult:
    export = is_export(converted)
    config = json.loads((converted / "config.json").read_text()) if export else read_mla_config(converted)
    original_path = _original_of(converted, original)
    output = Path(output) if output is not None else default_healed_output(converted)
    given = [] if texts is None or isinstance(texts, torch.Tensor) else texts
    text_inputs = [t for t in ([given] if isinstance(given, (str, Path)) else given) if isinstance(t, (str, Path))]
    with output_lock(output, [converted, original_path, *text_inputs], opts.force):
        device = opts.torch_device
        model = _load_converted(converted, config, export, device)
        orig_model = _load_original(original_path, model)
        vocab = config["vocab_size"]
        ids = _token_ids(texts, converted, vocab, opts.tokens, "--text")
        eval_ids = None if eval_texts is None else _token_ids(eval_texts, converted, vocab, opts.tokens, "--eval-text")
        report = heal_model(model, orig_model, *_split(ids, eval_ids), opts)
        report["inputs"] = {"converted": str(converted), "original": str(original_path)}
        report["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
        state = model.state_dict()
        layout, dtypes = {}, {}
        for file in weight_files(converted):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sliced = f.get_slice(name)
                    dtypes[name] = SAFETENSORS_DTYPES[sliced.get_dtype()]
                    layout[name] = (tuple(sliced.get_shape()), dtypes[name])
        metadata = {"format": "pt"}
        if not export:
            metadata["mla_format_version"] = str(config["mla"]["format_version"])
        with CheckpointWriter(output, layout, parse_size(opts.max_shard_size), opts.force, metadata) as writer:
            for name in layout:
                writer.write(name, state[name].detach().to("cpu", dtypes[name]).contiguous())
            for item in sorted(converted.iterdir()):
                if item.is_file() and item.suffix != ".safetensors" and item.name not in _NOT_CARRIED:
                    writer.copy_file(item.name, item)
            writer.write_json("healing.json", report)
            writer.write_text("healing.md", render_markdown(report))
            final = writer.commit()
    return HealResult(model, report, final)


def _load_converted(converted: Path, config: dict, export: bool, device) -> torch.nn.Module:
    """The converted model to train, in float32: the MLA model, or an export's transformers twin
    (`DeepseekV3ForCausalLM`, a vllm export with vLLM's latent-norm eps, so what is trained is
    what vLLM serves)."""
    if not export:
        return load_mla_model(converted, device=device, dtype=torch.float32)

    return load_export(converted, config["convert_export"], device, torch.float32)


def render_markdown(report: dict) -> str:
    """The healing report for people: before/after on the held-out tokens."""
    before, after = report["before"], report["after"]
    rows = [
        ("perplexity (converted)", before["ppl_converted"], after["ppl_converted"]),
        ("perplexity ratio to the original", before["ppl_ratio"], after["ppl_ratio"]),
        ("KL(original ‖ converted), mean per token", before["kl_mean"], after["kl_mean"]),
        ("top-1 agreement with the original", before["top1_agreement"], after["top1_agreement"]),
    ]
    lines = [
        "# Healing report",
        "",
        f"{report['steps']} steps of KL distillation toward the original (lr {report['lr']}, windows of "
        f"{report['window']} tokens, {report['train_tokens']} training tokens, {report['trained_parameters']:,} "
        f"trained parameters: the MLA projections only), {report['seconds']:.1f} s on {report['device']}.",
        f"Measured on {report['eval_tokens']} held-out tokens; the original's perplexity there is "
        f"{before['ppl_original']:.4g}.",
        "",
        "| | before | after |",
        "|---|---|---|",
        *(f"| {label} | {b:.6g} | {a:.6g} |" for label, b, a in rows),
        "",
    ]
    checks = report.get("checks")
    if checks:
        history = checks["history"]
        lines += [
            f"Checked every few steps on {checks['tokens']} tokens of the training text it was not trained on "
            f"(KL {history[0]['kl']:.4g} before, best {checks['best_kl']:.4g} at step {checks['best_step']}); "
            f"the rate was halved {checks['halvings']} times, and the weights kept are the best checked"
            f"{' (the unhealed ones)' if checks['best_step'] == 0 else ''}.",
            "",
        ]
    lines += [f"**{warning}**\n" for warning in healing_warnings(report)]
    return "\n".join(lines)


def healing_warnings(report: dict) -> list[str]:
    """What went wrong on the held-out tokens: perplexity worse, or the model further from the
    original (KL up, even where the perplexity fell: SmolLM2 at 75% of the cache, whose small gap
    a rate of 1e-3 without checks overshot, docs/compression.md, "Healing")."""
    before, after = report["before"], report["after"]
    warnings = []
    if not math.isfinite(after["ppl_converted"]) or after["ppl_ratio"] > before["ppl_ratio"]:
        warnings.append("Healing made the held-out perplexity worse: lower --lr or fewer --steps.")
    if not after["kl_mean"] <= before["kl_mean"]:
        warnings.append(
            f"Healing moved the model away from the original on the held-out tokens (KL {before['kl_mean']:.4g} -> "
            f"{after['kl_mean']:.4g}), whatever its perplexity says: heal on text more like the held-out text, "
            "lower --lr, or keep the unhealed model"
            + (
                "."
                if report.get("checks")
                else " (--check-every 25 keeps the weights best on unseen tokens of --text)."
            )
        )
    return warnings
