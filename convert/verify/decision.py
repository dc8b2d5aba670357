"""The verdict of a verification: thresholds by dtype, the three rules (round-off bounds; in half
precision the noise floor of `convert.verify.twin`; --max-ppl-ratio when lossy) and each check
against its bound (docs/design.md, "Verification"); `convert.verify.report` writes them out."""

import math

import torch

from convert.options import dtype_name

# Relative error of an exact conversion's layer output, by the coarsest dtype
# involved (the checkpoint's or the run's): round-off of that dtype, not a fit.
THRESHOLDS = {"float64": 1e-10, "float32": 1e-5}
E2E_FACTOR = 10  # logits and perplexity accumulate every layer's round-off
MIN_TOP1 = 0.999
# Half precision: no fixed bound fits (docs/design.md, "Verification"). An exact conversion is held to
# FLOOR_FACTOR times the error of the original's equivalent twin (`convert.verify.twin`), measured in
# the same run on the same inputs (bench/bf16_verdicts.py measures how far exact conversions sit below it).
HALF = ("float16", "bfloat16")
FLOOR_FACTOR = 4


def coarsest(*dtypes: torch.dtype) -> str:
    """The name of the least precise dtype among `dtypes`."""
    worst = max(dtypes, key=lambda d: torch.finfo(d).eps)
    return dtype_name(worst)


def thresholds(dtype_name: str, max_ppl_ratio: float | None) -> dict:
    """The bounds of a run whose coarsest dtype is `dtype_name`: fixed round-off bounds (float32/64),
    the noise floor's rule (`noise_floor`: half precision, exact), or the perplexity ratio (lossy)."""
    layer = THRESHOLDS.get(dtype_name)  # None in half precision: no fixed bound
    floor = dtype_name in HALF
    e2e = None if floor else E2E_FACTOR * THRESHOLDS[dtype_name]  # float32/float64: `layer` is set
    return {
        "dtype": dtype_name,
        "noise_floor": floor and max_ppl_ratio is None,
        "floor_factor": FLOOR_FACTOR if floor else None,
        "layer_rel_error": layer,
        "logits_rel_error": e2e,
        "ppl_rel_diff": e2e,
        "top1_agreement": None if floor else MIN_TOP1,
        "max_ppl_ratio": max_ppl_ratio,
    }


def decide(layers: list[dict], e2e: dict | None, limits: dict, extra_checks=()) -> dict:
    """The verdict, the rule that decided it and every figure it compared against its bound.

    exact (no --max-ppl-ratio): every layer's relative error, the logits' relative
    error, the perplexity difference and top-1 agreement against round-off bounds.
    lossy (--max-ppl-ratio): the perplexity ratio alone; per-layer errors are information.
    """
    if limits["max_ppl_ratio"] is not None:
        checks = [_lossy_check(e2e, limits["max_ppl_ratio"])]
        rule = (
            f"lossy conversion: perplexity ratio ≤ --max-ppl-ratio {limits['max_ppl_ratio']} on --text when given, "
            "else on the worst kind of the shipped held-out text"
        )
    elif limits["noise_floor"]:
        checks = _floor_checks(layers, e2e, limits["floor_factor"])
        rule = (
            f"exact conversion in {limits['dtype']}: each figure ≤ {limits['floor_factor']}× the noise floor, the "
            "same figure of the original's equivalent twin (attention weights reparametrised exactly, rounded to "
            f"{limits['dtype']})"
        )
    else:
        checks = _exact_checks(layers, e2e, limits)
        rule = f"exact conversion: round-off bounds of {limits['dtype']}"
    checks = list(extra_checks) + checks  # checks that hold whatever the rule (e.g. copied tensors)
    failed = [c["failure"] for c in checks if not c["ok"]]
    return {"verdict": "FAIL" if failed else "PASS", "rule": rule, "checks": checks, "failures": failed}


def check(name: str, value, bound, ok: bool, failure: str, over: float | None = None) -> dict:
    """One figure the verdict compared against its bound; `over`: the figure / its bound (> 1 fails)."""
    return {"name": name, "value": value, "bound": bound, "ok": bool(ok), "failure": failure, "over": over}


def _floor_check(name: str, value: float, floor: float, factor: int, what: str, fmt: str = ".3e") -> dict:
    """`value` ≤ factor × `floor` (the twin's figure), its failure naming both and how far over."""
    bound = factor * floor
    over = value / bound if bound > 0 else float("inf") if value > 0 else 0.0
    return check(
        name,
        value,
        f"≤ {factor}× {floor:{fmt}} = {bound:{fmt}}",
        value <= bound,
        f"{what} {value:{fmt}} > {factor}× the noise floor {floor:{fmt}} = {bound:{fmt}} ({over:.1f}× its bound)",
        over,
    )


def _floor_checks(layers: list[dict], e2e: dict | None, factor: int) -> list[dict]:
    """Each figure against `factor` times the twin's: every layer's relative error, the logits' relative
    error, |log perplexity ratio| (against the twin's mean |per-token NLL change|, which bounds it and
    is not the luck of a signed sum), and top-1 disagreement in tokens (the twin's counted as at least 1)."""
    checks = [
        _floor_check(
            f"layer {r['layer']} relative error",
            r["rel_error"],
            r["floor_rel_error"],
            factor,
            f"layer {r['layer']}: attention output relative error",
        )
        for r in layers
    ]
    if e2e is None:
        return checks
    floor = e2e["floor"]
    log_ratio = abs(math.log(e2e["ppl_ratio"]))
    tokens = e2e["tokens"]
    disagree = round((1 - e2e["top1_agreement"]) * tokens)  # tokens whose top-1 differs from the original's
    floor_disagree = max(round((1 - floor["top1_agreement"]) * tokens), 1)
    return checks + [
        _floor_check(
            "logits relative error", e2e["logits_rel_error"], floor["logits_rel_error"], factor, "logits relative error"
        ),
        _floor_check(
            "abs. log perplexity ratio",
            log_ratio,
            floor["nll_abs_diff_mean"],
            factor,
            f"perplexity {e2e['ppl_original']:.6g} -> {e2e['ppl_converted']:.6g}: |log ratio|",
        ),
        _floor_check(
            f"top-1 disagreement (of {tokens} tokens)", disagree, floor_disagree, factor, "top-1 disagreement", "d"
        ),
    ]


def _lossy_check(e2e: dict | None, max_ratio: float) -> dict:
    if e2e is None:
        return check(
            "perplexity ratio", None, max_ratio, False, "--max-ppl-ratio needs the end-to-end check, which did not run"
        )
    name, ratio = gate_text(e2e)
    return check(
        f"perplexity ratio on {name}",
        ratio,
        f"≤ {max_ratio}",
        ratio <= max_ratio,
        f"perplexity ratio {ratio:.4f} on {name} > --max-ppl-ratio {max_ratio}",
    )


def gate_text(e2e: dict) -> tuple[str, float]:
    """(the text a lossy conversion is judged on, its perplexity ratio): --text when it was given,
    else the worst of the texts judged (`by_text`); a report without them: the whole text."""
    rows = e2e.get("by_text") or []
    if not rows:
        return "the text", e2e["ppl_ratio"]
    given = [r for r in rows if r["text"].startswith("--text")]
    row = given[0] if given else max(rows, key=lambda r: r["ppl_ratio"])
    return row["text"], row["ppl_ratio"]


def _exact_checks(layers: list[dict], e2e: dict | None, limits: dict) -> list[dict]:
    bound = limits["layer_rel_error"]
    checks = [
        check(
            f"layer {r['layer']} relative error",
            r["rel_error"],
            f"≤ {bound:.0e}",
            r["rel_error"] <= bound,
            f"layer {r['layer']}: attention output relative error {r['rel_error']:.3e} > {bound:.0e}",
            r["rel_error"] / bound,
        )
        for r in layers
    ]
    if e2e is None:
        return checks
    logits, ppl, top1 = e2e["logits_rel_error"], abs(e2e["ppl_ratio"] - 1), e2e["top1_agreement"]
    return checks + [
        check(
            "logits relative error",
            logits,
            f"≤ {limits['logits_rel_error']:.0e}",
            logits <= limits["logits_rel_error"],
            f"logits relative error {logits:.3e} > {limits['logits_rel_error']:.0e}",
            logits / limits["logits_rel_error"],
        ),
        check(
            "perplexity ratio − 1 (abs.)",
            ppl,
            f"≤ {limits['ppl_rel_diff']:.0e}",
            ppl <= limits["ppl_rel_diff"],
            f"perplexity {e2e['ppl_original']:.6g} -> {e2e['ppl_converted']:.6g} differs by more than "
            f"{limits['ppl_rel_diff']:.0e}",
            ppl / limits["ppl_rel_diff"],
        ),
        check(
            "top-1 agreement",
            top1,
            f"≥ {limits['top1_agreement']}",
            top1 >= limits["top1_agreement"],
            f"top-1 agreement {top1:.4f} < {limits['top1_agreement']}",
            (1 - top1) / (1 - limits["top1_agreement"]),  # disagreement over the disagreement allowed
        ),
    ]
