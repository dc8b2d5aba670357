"""Perplexity vs KV-cache size of compressed (rank-reduced) conversions of SmolLM2-135M
(or, with --model gemma3, of Gemma 3 270M: q/k norms, factored layout only).

Calibrates on one Austen novel and evaluates on another (disjoint texts; nothing
is tuned on the evaluation text). For each method × layout × cache ratio the
conversion runs through the public API (`convert.convert_state_dict`, the same
code as `convert gqa2mla --kv-cache-ratio R --method M --calib FILE`), and the
converted model's perplexity is compared with the original's.

    python bench/compression.py                       # full table (~15 min on 2 cores)
    python bench/compression.py --ratios 0.5 --methods fisher --layouts factored
    python bench/compression.py --render              # table and plot from the saved JSON only
    python bench/compression.py --model gemma3        # the second family (results/compression_gemma3.json)

A full run (and `--render`) writes the perplexity-vs-cache plot
(bench/results/compression.png) and rewrites docs/compression.md's table between its
`compression-table` markers, so what the docs show is what was measured.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import realdata  # noqa: E402

import convert  # noqa: E402
from convert.mla.model import build_mla_model  # noqa: E402
from convert.verify.e2e import perplexity  # noqa: E402

#: The real models measured: (fixture directory, name, default layouts, default methods, results file).
MODELS = {
    "smollm2": (realdata.smollm2_dir, "SmolLM2-135M", "factored,absorbed", "svd,whitened,fisher", "compression.json"),
    # q/k norms: compressed after the norm, in the factored layout and from calibration statistics only
    "gemma3": (realdata.gemma3_dir, "Gemma 3 270M", "factored", "whitened,fisher", "compression_gemma3.json"),
}

#: The compression issue's one-shot goals (perplexity × the original's) per layout and cache share.
TARGETS = {"factored": {0.75: 1.03, 0.5: 1.10, 0.25: 1.35}, "absorbed": {0.75: 1.05, 0.5: 1.15, 0.25: 1.45}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--calib-book", default="prideprejudice")
    p.add_argument("--eval-book", default="emma")
    p.add_argument("--calib", type=Path, default=None, help="calibrate on this UTF-8 text instead of --calib-book")
    p.add_argument("--eval-text", type=Path, default=None, help="judge on this UTF-8 text instead of --eval-book")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--ratios", "--shares", dest="ratios", default="1,0.75,0.5,0.25", help="shares of the GQA cache")
    p.add_argument("--methods", default=None, help="default: every method the model allows")
    p.add_argument("--layouts", default=None, help="default: every layout the model compresses in")
    p.add_argument(
        "--nope-angles",
        default=None,
        help="absorbed layout: compare these --nope-angle values side by side (e.g. 0,0.75); default the option's",
    )
    p.add_argument(
        "--calibrations",
        default=None,
        help="--calibration values to compare side by side (original, sequential); default the option's own "
        "default per layout; svd rows run once",
    )
    p.add_argument(
        "--refine-steps",
        default=None,
        help="--refine-steps values to compare side by side (e.g. 0,50); default the option's own (sized to the device)",
    )
    p.add_argument("--out", type=Path, default=None, help="default bench/results/compression[_MODEL].json")
    p.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: redraw the plot and rewrite the docs' table from --out",
    )
    p.add_argument(
        "--readme",
        type=Path,
        default=HERE.parent / "docs" / "compression.md",
        help="document whose compression-table block is rewritten (only by a full run or --render)",
    )
    args = p.parse_args(argv)
    _, _, layouts, methods, results = MODELS[args.model]
    args.layouts, args.methods = args.layouts or layouts, args.methods or methods
    args.out = args.out or HERE / "results" / results
    return args


def token_ids(tokenizer, book: str, n: int, path: Path | None = None) -> torch.Tensor:
    """The first n token ids of `path`'s text, or of the Austen novel `book`."""
    text = path.read_text(encoding="utf-8") if path is not None else realdata.austen_text(book)
    ids = tokenizer(text)["input_ids"][:n]
    return torch.tensor(ids)[None]


def run_one(
    model, calib_ids, eval_ids, window, method, layout, ratio, nope_angle=None, calibration="original", refine=None
) -> dict:
    t0 = time.perf_counter()
    options = dict(layout=layout, kv_cache_ratio=ratio if ratio < 1 else None, calibration=calibration)
    options |= {} if refine is None or method == "svd" else {"refine_steps": refine}
    options |= {} if nope_angle is None else {"nope_angle": nope_angle}
    if ratio < 1:
        options |= dict(method=method, calib=calib_ids if method != "svd" else None, calib_tokens=calib_ids.shape[-1])
    state = convert.convert_state_dict(model.state_dict(), model.config, **options)
    convert_s = time.perf_counter() - t0
    mla_model = build_mla_model(state.config, dict(state), torch.float32)
    ppl = perplexity(mla_model, eval_ids, window)
    comp = state.config["mla"]["compression"] or {}
    return {
        "method": method if ratio < 1 else "exact",
        "layout": layout,
        "ratio": ratio,
        "cache_dims": comp.get("cache_dims", sum(l["rank_k"] + l["rank_v"] for l in state.config["mla"]["layers"])),
        "achieved_ratio": comp.get("achieved_ratio", 1.0),
        "ranks_k": [l["rank_k"] for l in state.config["mla"]["layers"]],
        "ranks_v": [l["rank_v"] for l in state.config["mla"]["layers"]],
        "nope_angle": comp.get("nope_angle", 0.0) if layout == "absorbed" and ratio < 1 else None,
        "static_freqs": comp.get("static_freqs", []),
        "calibration": comp.get("calibration") or "original",
        "refine_steps": comp.get("refine_steps", 0),
        "ppl": ppl,
        "convert_s": convert_s,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        render(json.loads(args.out.read_text()), args)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = MODELS[args.model][0]()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    calib_ids = token_ids(tokenizer, args.calib_book, args.calib_tokens, args.calib)
    eval_ids = token_ids(tokenizer, args.eval_book, args.eval_tokens, args.eval_text)
    base = perplexity(model, eval_ids, args.window)
    print(
        f"original perplexity on {args.eval_text or args.eval_book} ({eval_ids.shape[-1]} tokens): {base:.4f}",
        flush=True,
    )
    rows = []
    ratios = [float(r) for r in args.ratios.split(",")]
    angles = [None] if args.nope_angles is None else [float(a) for a in args.nope_angles.split(",")]
    calibrations = [None] if args.calibrations is None else args.calibrations.split(",")
    refines = [None] if args.refine_steps is None else [int(n) for n in args.refine_steps.split(",")]
    runs = [
        (layout, ratio, method, angle, calibration, refine)
        for layout in args.layouts.split(",")
        for ratio in ratios
        for method in (args.methods.split(",") if ratio < 1 else ["exact"])
        for angle in (angles if layout == "absorbed" and ratio < 1 else [None])
        for calibration in (calibrations if method in ("whitened", "fisher") else [None])
        for refine in (refines if method in ("whitened", "fisher") else [None])
    ]
    for layout, ratio, method, angle, calibration, refine in runs:
        row = run_one(model, calib_ids, eval_ids, args.window, method, layout, ratio, angle, calibration, refine)
        row["ppl_ratio"] = row["ppl"] / base
        row["target"] = TARGETS[layout].get(ratio)
        rows.append(row)
        print(
            f"{layout:9s} {ratio:5.2f} {row['method']:9s} {row['calibration']:10s} nope {row['nope_angle']} "
            f"cache {row['achieved_ratio']:.4f} "
            f"refine {row['refine_steps']} ppl {row['ppl']:9.3f} ×{row['ppl_ratio']:.3f} ({row['convert_s']:.0f}s)",
            flush=True,
        )
        print(f"share {ratio:g} ppl_ratio {row['ppl_ratio']:.3f}", flush=True)
    result = {
        "model": MODELS[args.model][1],
        "original_ppl": base,
        "calib": {"book": str(args.calib or args.calib_book), "tokens": calib_ids.shape[-1]},
        "eval": {"book": str(args.eval_text or args.eval_book), "tokens": eval_ids.shape[-1], "window": args.window},
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if args.out == parse_args(["--model", args.model]).out:  # the full default table: the docs show it
        render(result, args)


def markers(model: str) -> tuple[str, str]:
    """The docs block of `model`'s table."""
    command = "bench/compression.py" + ("" if model == "smollm2" else f" --model {model}")
    return f"<!-- compression-table: {command} -->", "<!-- /compression-table -->"


def render(result: dict, args) -> None:
    """The plot beside --out (.png) and the docs table block, from one result."""
    plot = args.out.with_suffix(".png")
    draw(result, plot)
    begin, end = markers(args.model)
    text = args.readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{args.readme}: no '{begin}' ... '{end}' block to rewrite")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    image = os.path.relpath(plot, args.readme.parent)
    block = f"{begin}\n{markdown(result)}\n\n![perplexity vs KV cache]({image})\n{end}"
    args.readme.write_text(head + block + tail)
    print(f"wrote {plot} and the table in {args.readme}")


def _variants(rows: list[dict]) -> dict:
    """(layout, method, nope angle, calibration) of every compressed row, in order."""
    return dict.fromkeys(_variant(r) for r in rows if r["method"] != "exact")


def _variant(r: dict) -> tuple:
    """A row's (layout, method, nope angle, calibration, refinement steps)."""
    return r["layout"], r["method"], r.get("nope_angle"), r.get("calibration", "original"), r.get("refine_steps", 0)


def _curve(rows: list[dict], variant: tuple) -> list[dict]:
    """The rows of one variant, with its layout's exact (100%) row: one line of the plot or the table."""
    return [r for r in rows if _variant(r) == variant or (r["method"] == "exact" and r["layout"] == variant[0])]


def _label(method: str, angle, calibration: str, refine: int = 0) -> str:
    label = method if angle is None else f"{method}, --nope-angle {angle:g}"
    label += ", sequential" if calibration == "sequential" else ""
    return label + (f", refined ({refine} steps)" if refine else "")


def draw(result: dict, path: Path) -> None:
    """Perplexity (× the original's, log scale) against the share of the GQA cache kept,
    one line per layout and method, the goals as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for layout, method, angle, calibration, refine in _variants(rows):
        if method == "svd":
            continue  # ×266 and up: it would flatten every other line
        hit = sorted(_curve(rows, (layout, method, angle, calibration, refine)), key=lambda r: r["achieved_ratio"])
        style = "-" if layout == "factored" else "--"
        ax.plot(
            [r["achieved_ratio"] for r in hit],
            [r["ppl_ratio"] for r in hit],
            style,
            marker="o",
            label=f"{layout}, {_label(method, angle, calibration, refine)}",
        )
    for layout, marker in (("factored", "v"), ("absorbed", "1")):
        if not any(r["layout"] == layout for r in rows):
            continue
        goals = TARGETS[layout]
        ax.scatter(list(goals), list(goals.values()), marker=marker, color="black", label=f"goal, {layout}")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("×%.2f"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("×%.2f"))
    ax.set_xlabel("share of the GQA KV cache kept")
    ax.set_ylabel("perplexity / original")
    ev = result["eval"]
    ax.set_title(
        f"{result.get('model', 'SmolLM2-135M')}, one-shot: {ev['book']} ({ev['tokens']} tokens), original ppl {result['original_ppl']:.2f}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(result: dict) -> str:
    rows = result["rows"]
    ratios = sorted({r["ratio"] for r in rows}, reverse=True)
    lines = [
        "| layout | method | " + " | ".join(f"{r:.0%} cache" for r in ratios) + " |",
        "|---|---|" + "---:|" * len(ratios),
    ]
    for variant in _variants(rows):
        layout, method, angle, calibration, refine = variant
        curve = _curve(rows, variant)
        cells = []
        for ratio in ratios:
            hit = [r for r in curve if r["ratio"] == ratio]
            cells.append(f"{hit[0]['ppl']:.2f} (×{hit[0]['ppl_ratio']:.3f})" if hit else "")
        lines.append(f"| {layout} | {_label(method, angle, calibration, refine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
