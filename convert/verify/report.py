"""The verification report written out: JSON (data first, schema below), Markdown, the summary
lines and the per-layer plot (docs/design.md, "Verification"); `convert.verify.decision` decides
the verdict it reports.
"""

# Schema `convert.verification/1` (verification.json):
#   schema             "convert.verification/1"
#   verdict            "PASS" | "FAIL"
#   decision           {verdict, rule: which rule decided (exact: round-off bounds, or in half precision the
#                       noise floor; lossy: --max-ppl-ratio), checks: [{name, value, bound, ok, failure,
#                       over (value / bound, or null)}], failures}
#   failures           [str]: one line each, naming the layer or metric
#   thresholds         {dtype, noise_floor (bool), floor_factor, layer_rel_error, logits_rel_error, ppl_rel_diff,
#                       top1_agreement (the fixed bounds; null under the noise floor), max_ppl_ratio}
#   layers             [{layer, rel_error, max_abs_error, floor_rel_error, floor_max_abs_error (the twin's, or
#                       null), ranks, retained_energy, factor_error}]
#   end_to_end         {tokens, logits_max_abs_diff, logits_rel_error, kl_mean, kl_max, top1_agreement,
#                       ppl_original, ppl_converted, ppl_ratio, nll_abs_diff_mean, floor (the twin's same
#                       figures, or absent), greedy_original, greedy_converted,
#                       greedy_match, greedy_prompt_text, greedy_text_{original,converted} (null without a tokenizer),
#                       kv_cache_bytes_per_token_{original,converted} (in kv_cache_dtype, the checkpoint's),
#                       params_{original,converted}, mode (whole | streamed),
#                       greedy_dtype (the greedy run's: whole, the run's dtype; auto, float32 unless --dtype),
#                       greedy_how ("whole models", or "streamed: …" and why), greedy_skipped (null, or why:
#                       greedy_* are then null)}
#                      or null, with end_to_end_skipped: reason
#   inputs             {original: {path, files: {name: sha256}}, converted: {…}, text: {path, sha256, tokens} | null}
#   options, versions  {convert, torch, transformers, python}, device {type, name}, dtype, timings {…_s}
#   memory             {cap_bytes (the run's bound on resident memory), cap_explicit (--max-memory), cap_why,
#                       peak_rss_bytes (the process's peak resident memory, measured as the report is made)}
#   target             the vllm export's section (cache sizes, perplexity ratio, note), only for --target vllm
#   plot               whether verification_layers.png was written (matplotlib present)

import json
from pathlib import Path


def render_markdown(report: dict) -> str:
    """A human rendering of the JSON report."""
    decision = report["decision"]
    lines = [f"# Verification: {report['verdict']}", "", f"Decided by the {decision['rule']}.", ""]
    lines += [f"- **FAIL**: {f}" for f in report["failures"]] + ([""] if report["failures"] else [])
    lines += _decision_table(decision)
    lines += [
        f"- original: `{report['inputs']['original']['path']}`"
        + (
            f" ({report['inputs']['original']['description']})"
            if report["inputs"]["original"].get("description")
            else ""
        ),
        f"- converted: `{report['inputs']['converted']['path']}`",
        f"- device: {report['device']['type']} ({report['device']['name']}), run dtype {report['dtype']}",
        f"- inputs: {_input_line(report)}",
        *_calibration_line(report),
        *_memory_line(report),
        "",
    ]
    lossy = report["thresholds"]["max_ppl_ratio"] is not None
    target = report.get("target")
    if target:
        ratio = target["perplexity_ratio"]
        lines += [
            f"## Target {target['name']}",
            "",
            f"- cache per token: {target['cache_bytes_per_token']:,} bytes "
            f"({target['cache_values_per_token_per_layer']} values per layer) against the original GQA cache's "
            f"{target['gqa_cache_bytes_per_token']:,} bytes ({target['gqa_cache_values_per_token_per_layer']} per layer)",
            f"- perplexity ratio (converted / original) on the verification tokens: "
            f"{'n/a' if ratio is None else f'{ratio:.4f}'}",
            f"- {target['note']}",
            "",
        ]
    if not report["layers"]:
        lines += [
            "## Per layer",
            "",
            "None: an export target's layers are its runtime's own modules; it is checked end to end.",
            "",
        ]
        return "\n".join(lines + _by_text_lines(report) + _e2e_lines(report) + ["", _timings_line(report)]) + "\n"
    floor = report["layers"][0].get("floor_rel_error") is not None
    lines += [
        "## Per layer" + (" (information: a lossy conversion is judged by perplexity)" if lossy else ""),
        "",
        "| layer | ranks | rel. error | max abs error |"
        + (" noise floor (twin) | × floor |" if floor else "")
        + " retained energy |",
        "|---:|---|---:|---:|" + ("---:|---:|" if floor else "") + "---|",
    ]
    for r in report["layers"]:
        ranks = ", ".join(f"{k.removeprefix('rank_')}={v}" for k, v in r["ranks"].items())
        energy = ", ".join(f"{k}={v:.6f}" for k, v in (r["retained_energy"] or {}).items())
        twin = f" {r['floor_rel_error']:.2e} | {r['rel_error'] / r['floor_rel_error']:.2f} |" if floor else ""
        lines.append(f"| {r['layer']} | {ranks} | {r['rel_error']:.2e} | {r['max_abs_error']:.2e} |{twin} {energy} |")
    lines += ["", "![per-layer error](verification_layers.png)", ""] if report.get("plot") else [""]
    lines += _by_text_lines(report)
    lines += _e2e_lines(report)
    lines += ["", _timings_line(report)]
    return "\n".join(lines) + "\n"


def _by_text_lines(report: dict) -> list[str]:
    """A lossy conversion's perplexity on each text judged, the worst first, and the warnings."""
    rows = (report.get("end_to_end") or {}).get("by_text")
    if not rows:
        return []
    lines = [
        "## Perplexity by kind of text",
        "",
        "| text | tokens | original | converted | × |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: -r["ppl_ratio"]):
        lines.append(
            f"| {r['text']} | {r['tokens']} | {r['ppl_original']:.4g} | {r['ppl_converted']:.4g} | {r['ppl_ratio']:.4f} |"
        )
    return lines + [""] + [f"- {w}" for w in text_warnings(report)] + [""]


def text_warnings(report: dict) -> list[str]:
    """What a lossy conversion's report says of its texts: the worst kind, and when the calibration
    and the judging text are of one kind (their figures flatter it) or of kinds it cannot tell."""
    rows = (report.get("end_to_end") or {}).get("by_text")
    if not rows:
        return []
    worst = max(rows, key=lambda r: r["ppl_ratio"])
    out = [f"worst: {worst['text']}, perplexity ×{worst['ppl_ratio']:.3f} the original's"]
    calibrated = report["options"].get("calibrated_on")
    if not calibrated:
        return out + ["what it was calibrated on is not recorded (weight SVD reads no text; an older checkpoint)"]
    shipped = {r["text"]: r for r in rows if not r["text"].startswith("--text")}
    own = [name for name in calibrated if name not in shipped]
    given = report["options"].get("text")
    if given and Path(given).name in own:
        out.append(f"--text {Path(given).name} is also calibration text: judged on what it was fitted to, it flatters")
    if len(calibrated) == 1 and calibrated[0] in shipped:
        kind = calibrated[0]
        others = [r for name, r in shipped.items() if name != kind]
        other = max(others, key=lambda r: r["ppl_ratio"])
        out.append(
            f"calibrated on one kind of text ({kind}): ×{shipped[kind]['ppl_ratio']:.3f} on {kind}, the calibration's "
            f"own kind, up to ×{other['ppl_ratio']:.3f} on another ({other['text']}); calibrate on the shipped mix "
            "(no --calib) or on text like what the model will be sent"
        )
    elif own:
        out.append(
            f"calibrated on {', '.join(own)}: of kinds not known here; the shipped kinds above are judged as well"
        )
    return out


def _timings_line(report: dict) -> str:
    return "Timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in report["timings"].items())


def _decision_rows(decision: dict) -> list[dict]:
    """The checks the verdict compared, the per-layer ones folded into their worst."""
    layer_checks = [c for c in decision["checks"] if c["name"].startswith("layer ")]
    rows = [c for c in decision["checks"] if not c["name"].startswith("layer ")]
    if layer_checks:
        worst = max(layer_checks, key=lambda c: c["value"] if c["over"] is None else c["over"])
        ok = all(c["ok"] for c in layer_checks)
        rows.insert(0, {**worst, "name": f"worst layer relative error ({worst['name'].split()[1]})", "ok": ok})
    return rows


def _value(check: dict) -> str:
    value = check["value"]
    return "—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _decision_table(decision: dict) -> list[str]:
    """The figures the verdict compared, against their bounds (per-layer rows folded into one)."""
    out = ["| check | value | bound | |", "|---|---:|---|---|"]
    for c in _decision_rows(decision):
        out.append(f"| {c['name']} | {_value(c)} | {c['bound']} | {'ok' if c['ok'] else '**FAIL**'} |")
    return out + [""]


def summary_lines(report: dict) -> list[str]:
    """What `convert verify` prints (the whole report: `render_markdown`): the verdict and its rule,
    one line per check it compared (the per-layer ones folded into their worst), greedy generation."""
    lines = [f"verification: {report['verdict']} (decided by the {report['decision']['rule']})"]
    for c in _decision_rows(report["decision"]):
        lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['name']}: {_value(c)} ({c['bound']})")
    e2e = report.get("end_to_end")
    if e2e and "greedy_match" in e2e:
        lines.append(f"  greedy continuation identical: {_greedy_cell(e2e)}")
    return lines + [f"  note: {w}" for w in text_warnings(report)]


def _input_line(report: dict) -> str:
    text = report["inputs"]["text"]
    if text is None:
        return f"random hidden states / tokens ({report['options']['tokens']} tokens)"
    shipped = text.get("shipped_kinds")
    parts = ([f"text `{text['path']}`"] if text.get("path") else []) + (
        [f"the shipped held-out text ({', '.join(shipped)})"] if shipped else []
    )
    return f"{' and '.join(parts)} ({text['tokens']} tokens, real hidden states)"


def _e2e_lines(report: dict) -> list[str]:
    e2e = report["end_to_end"]
    if e2e is None:
        return ["## End to end", "", f"Skipped: {report.get('end_to_end_skipped')}"]
    rows = [
        ("logits max abs diff", f"{e2e['logits_max_abs_diff']:.3e}"),
        ("logits relative error", f"{e2e['logits_rel_error']:.3e}"),
        ("KL(original ‖ converted), mean / max", f"{e2e['kl_mean']:.3e} / {e2e['kl_max']:.3e}"),
        ("top-1 agreement", f"{e2e['top1_agreement']:.4%}"),
        (
            "perplexity original → converted",
            f"{e2e['ppl_original']:.6g} → {e2e['ppl_converted']:.6g} (×{e2e['ppl_ratio']:.6f})",
        ),
        ("end-to-end mode", e2e.get("mode", "whole")),
        ("greedy continuation identical", _greedy_cell(e2e)),
        (
            f"KV cache bytes/token original → converted ({e2e.get('kv_cache_dtype', report['dtype'])})",
            f"{e2e['kv_cache_bytes_per_token_original']:.0f} → {e2e['kv_cache_bytes_per_token_converted']:.0f}",
        ),
        ("parameters original → converted", f"{e2e['params_original']:,} → {e2e['params_converted']:,}"),
    ]
    lines = ["## End to end", "", "| check | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return lines + _floor_lines(e2e) + _greedy_lines(e2e)


def _floor_lines(e2e: dict) -> list[str]:
    """The conversion's end-to-end figures beside the twin's (the noise floor), when it was measured."""
    floor = e2e.get("floor")
    if floor is None:
        return []
    rows = [
        ("logits relative error", "logits_rel_error", ".3e"),
        ("logits max abs diff", "logits_max_abs_diff", ".3e"),
        ("KL mean", "kl_mean", ".3e"),
        ("KL max", "kl_max", ".3e"),
        ("top-1 agreement", "top1_agreement", ".4%"),
        ("perplexity ratio", "ppl_ratio", ".6f"),
        ("mean abs. per-token NLL change", "nll_abs_diff_mean", ".3e"),
    ]
    lines = ["", "Against the noise floor (the original's equivalent twin, one rounding away from it):", ""]
    lines += ["| figure | converted | twin (floor) |", "|---|---:|---:|"]
    return lines + [f"| {name} | {e2e[key]:{fmt}} | {floor[key]:{fmt}} |" for name, key, fmt in rows]


def _calibration_line(report: dict) -> list[str]:
    calibrated = report["options"].get("calibrated_on")
    return [f"- calibrated on: {', '.join(calibrated)}"] if calibrated else []


def _memory_line(report: dict) -> list[str]:
    memory = report.get("memory")
    if not memory:  # a report from before the cap
        return []
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    return [
        f"- memory: peak {gib(memory['peak_rss_bytes'])} resident, cap {gib(memory['cap_bytes'])} ({memory['cap_why']})"
    ]


def _greedy_cell(e2e: dict) -> str:
    if e2e.get("greedy_skipped"):
        return f"not run: {e2e['greedy_skipped']}"
    how = [e2e["greedy_dtype"]] if e2e.get("greedy_dtype") else []
    how += ["streamed layer by layer"] if (e2e.get("greedy_how") or "").startswith("streamed") else []
    return ("yes" if e2e["greedy_match"] else "no") + (f" ({', '.join(how)})" if how else "")


def _greedy_lines(e2e: dict) -> list[str]:
    """The greedy continuations, as text when the model has a tokenizer (else token ids)."""
    if e2e.get("greedy_skipped"):
        return ["", f"Greedy generation skipped: {e2e['greedy_skipped']}."]
    if e2e.get("greedy_text_original") is None:
        return ["", f"Greedy tokens: original {e2e['greedy_original']}", f"converted {e2e['greedy_converted']}"]
    quote = lambda t: "> " + t.replace("\n", "\n> ")
    return [
        "",
        f"Greedy continuation of: {e2e['greedy_prompt_text']!r}",
        "",
        "Original:",
        "",
        quote(e2e["greedy_text_original"]),
        "",
        "Converted:",
        "",
        quote(e2e["greedy_text_converted"]),
    ]


def plot_layers(report: dict, path: Path) -> bool:
    """Per-layer relative error against the threshold, as a PNG. False if matplotlib is missing."""
    try:
        import matplotlib  # optional and heavy: only the PNG plot needs it (without it the report has no plot)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # deferred: the Agg backend must be chosen before pyplot is imported
        import matplotlib.ticker  # optional: only the plot needs it, as above
    except ImportError:
        return False
    if not report["layers"]:
        return False
    layers = [r["layer"] for r in report["layers"]]
    errors = [max(r["rel_error"], 1e-18) for r in report["layers"]]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    ax.semilogy(layers, errors, "o-", label="attention output relative error")
    factor = report["thresholds"].get("floor_factor")
    if report["layers"][0].get("floor_rel_error") is not None:
        floors = [r["floor_rel_error"] for r in report["layers"]]
        ax.semilogy(layers, floors, "s:", color="gray", label="noise floor (twin)")
        ax.semilogy(layers, [factor * f for f in floors], "--", color="red", label=f"threshold ({factor}× floor)")
    elif report["thresholds"]["layer_rel_error"] is not None:
        ax.axhline(report["thresholds"]["layer_rel_error"], color="red", ls="--", label="threshold")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("relative Frobenius error")
    ax.set_title(f"Verification: {report['verdict']} ({report['dtype']} on {report['device']['type']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_report(report: dict, directory) -> None:
    """verification.json, verification_layers.png and verification.md into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    report["plot"] = plot_layers(report, directory / "verification_layers.png")
    (directory / "verification.json").write_text(json.dumps(report, indent=2) + "\n")
    (directory / "verification.md").write_text(render_markdown(report))


def original_named_by(converted: Path) -> Path | None:
    """The original checkpoint a conversion's verification.json names, when it still exists."""
    report = Path(converted) / "verification.json"
    if not report.is_file():
        return None
    try:
        found = json.loads(report.read_text()).get("inputs", {}).get("original", {}).get("path")
    except (ValueError, AttributeError):
        return None  # not a report of ours: as if there were none
    return Path(found) if found and Path(found).exists() else None
