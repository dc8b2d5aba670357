"""The healing report for people (healing.md) and its warnings, from healing.json's figures."""

import math


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
            + ("." if report.get("checks") else " (--check-every N keeps the weights best on unseen tokens of --text).")
        )
    return warnings
