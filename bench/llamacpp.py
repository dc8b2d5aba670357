"""An original GGUF and its `--target llamacpp` conversions side by side in real llama.cpp.

For one model, in one run: the original as llama.cpp's own converter writes it (F16) and as its
quantizer makes it (Q4_K_M), and this package's deepseek2 files at each --kv-cache-ratio share
(1 = the full latent), F16 and Q4_K_M (llama.cpp's quantizer on our F16 file). For each file:
  - the KV cache's size as llama.cpp itself reports it (its `llama_kv_cache: size = ... MiB` line),
    at each context, and at each --kv-contexts one (a context made, nothing evaluated: 32K prompts
    take hours on 2 cores);
  - prompt tokens/s over a prompt of that context, and decode tokens/s at that context (the median
    of --decode greedy steps after it), every file at one context before the next context;
  - perplexity from llama.cpp's own logits on the shipped held-out text of every kind (fiction,
    technical, code, dialogue; --eval-tokens each), and its ratio to the original of the same type.
Then a table, one line per figure (`smollm2 kv_ratio_32768_0.25_F16 0.251`), the goals, a PNG of KV
memory and decode speed against context, and the JSON (written after every measurement).

    python bench/llamacpp.py --model smollm2 [--shares 1,0.5,0.25] [--types F16,Q4_K_M]
        [--contexts 1024,8192] [--kv-contexts 32768] [--decode 32] [--eval-tokens 1024] [--threads 2]

llama.cpp runs with flash attention on (as its own tools do by default; bench/llamacpp_run.py says
why it matters for MLA); CONVERT_LLAMACPP_FLASH_ATTN=0 measures without it.

Needs: llama.cpp's engine (bash scripts/llamacpp_env.sh), and for the original's GGUF llama.cpp's
own convert_hf_to_gguf.py, taken from the llama-cpp-python 0.3.36 sdist (pip download, kept in the
fixture cache) and run here, which needs `pip install sentencepiece`. Conversions use the shipped
calibration mix (the default). Run it alone: every figure is a timing on the machine's cores, and
llama.cpp's threads wait on each other at every op, so one busy core stalls them all: beside another
job, one file's decode step measured 4.1 s in one run and 0.07-0.23 s in the next (the "100x
slower" Q4_K_M decode of an earlier contended smoke run was this, not the file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

RUN = _common.BENCH / "llamacpp_run.py"
SDIST = "llama-cpp-python==0.3.36"
KV_LINE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells")
GOAL_KV_AT_25, GOAL_FULL_PPL, GOAL_Q4_DELTA = 0.27, 1.05, 0.02


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("smollm2", "qwen25coder"), default="smollm2")
    p.add_argument(
        "--shares", default="1,0.5,0.25",
        help="--kv-cache-ratio shares (1: the full latent); SHARE/N converts with --latent-multiple N as well",
    )  # fmt: skip
    p.add_argument("--types", default="F16,Q4_K_M", help="tensor types: F16 and/or Q4_K_M")
    p.add_argument("--contexts", default="1024,8192", help="prompt lengths the speed and KV size are taken at")
    p.add_argument("--kv-contexts", default="32768", help="contexts the KV size alone is taken at ('' for none)")
    p.add_argument("--decode", type=int, default=32, help="greedy steps timed after each prompt (median)")
    p.add_argument("--eval-tokens", type=int, default=1024, help="tokens of each kind of held-out text")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calib-tokens", type=int, default=None, help="the conversions' (default: the package's)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/llamacpp/llamacpp_<model>.json)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the files


def source_dir(model: str) -> Path:
    """The Hugging Face directory the conversions read (and llama.cpp's converter, for the F16 original)."""
    import realdata

    return Path(realdata.smollm2_dir() if model == "smollm2" else realdata.qwen25_coder_dir())


def hf_to_gguf_script() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist (downloaded once into the
    fixture cache: the package's registry holds it, with llama.cpp vendored)."""
    import realdata

    home = Path(realdata.cache_dir()) / "llama-cpp-python-sdist"
    script = next(home.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"), None)
    if script is not None:
        return script
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp]
        subprocess.run(cmd, check=True)
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            tar.extractall(home, filter="data")
    return next(home.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))


def originals(model: str, work: Path, types: list[str]) -> dict[str, Path]:
    """The original as GGUF, by type: F16 by llama.cpp's converter, Q4_K_M by its quantizer (for
    Qwen2.5-Coder, the registry's own Q4_K_M file)."""
    import realdata

    from convert.targets.llamacpp import quantize

    f16 = work / "original-F16.gguf"
    if not f16.is_file():
        try:
            import sentencepiece  # noqa: F401  (llama.cpp's converter tries it first)
        except ImportError:
            sys.exit("llama.cpp's convert_hf_to_gguf.py needs sentencepiece here: pip install sentencepiece")
        cmd = [sys.executable, str(hf_to_gguf_script()), str(source_dir(model)), "--outtype", "f16", "--outfile"]
        subprocess.run([*cmd, str(f16)], check=True, capture_output=True)
    files = {"F16": f16}
    if "Q4_K_M" in types:
        q4 = work / "original-Q4_K_M.gguf"
        if model == "qwen25coder":
            q4 = Path(realdata.qwen25_coder_gguf())
        elif not q4.is_file():
            quantize(f16, q4, "Q4_K_M")
        files["Q4_K_M"] = q4
    return files


def parse_share(token: str) -> tuple[float, int | None]:
    """`--shares` entry: SHARE or SHARE/N (--latent-multiple N)."""
    share, _, multiple = token.partition("/")
    return float(share), int(multiple) if multiple else None


def share_tag(share: float, multiple: int | None) -> str:
    return f"{share:g}" if multiple is None else f"{share:g}/{multiple}"


def converted(
    model: str, work: Path, share: float, types: list[str], calib_tokens, multiple: int | None = None
) -> tuple[dict[str, Path], float]:
    """Our deepseek2 file at `share` (F16, then Q4_K_M by llama.cpp's quantizer), the latent rounded up
    to `multiple` (--latent-multiple), and the seconds the conversion took (the shipped calibration mix,
    no verification: judged here, in llama.cpp)."""
    import convert
    from convert.targets.llamacpp import QUANT_OVERRIDES, quantize

    name = f"mla-{share:g}" + ("" if multiple is None else f"-m{multiple}")
    out = work / name if calib_tokens is None else work / f"{name}-calib{calib_tokens}"
    seconds = 0.0
    if not (out / "model.gguf").is_file():
        t0 = time.perf_counter()
        ratio = None if share >= 1 else share
        options = {} if calib_tokens is None else {"calib_tokens": calib_tokens}
        options |= {} if multiple is None else {"latent_multiple": multiple}
        convert.gqa2mla(
            source_dir(model), out, target="llamacpp", gguf_type="F16", kv_cache_ratio=ratio, verify=False, **options
        )
        seconds = time.perf_counter() - t0
    files = {"F16": out / "model.gguf"}
    if "Q4_K_M" in types:  # as --gguf-type Q4_K_M makes it: the latent's tensors Q8_0 (QUANT_OVERRIDES)
        q4 = out.with_name(out.name + "-Q4_K_M-latentQ8.gguf")
        if not q4.is_file():
            quantize(out / "model.gguf", q4, "Q4_K_M", QUANT_OVERRIDES["Q4_K_M"])
        files["Q4_K_M"] = q4
    return files, seconds


# ---------------------------------------------------------------- llama.cpp's figures


def engine(python: Path, *args) -> tuple[dict, str]:
    """(the last stdout line as JSON, stderr) of llamacpp_run.py in the engine's python."""
    run = subprocess.run([str(python), str(RUN), *map(str, args)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp run {args[:2]} failed: {run.stderr[-1500:]}")
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def kv_bytes(stderr: str, context: int) -> int:
    """The KV cache's size llama.cpp logged for a context of `context` cells (MiB -> bytes)."""
    for mib, cells in KV_LINE.findall(stderr):
        if int(cells) >= context:
            return round(float(mib) * 2**20)
    raise RuntimeError("llama.cpp logged no `llama_kv_cache: size` line")


def judging(model: str, eval_tokens: int) -> dict[str, list[int]]:
    """The shipped held-out text of every kind, `eval_tokens` each, in the model's tokenizer."""
    from convert.io import open_checkpoint
    from convert.text import judging_ids

    root = source_dir(model)
    with open_checkpoint(root) as source:
        vocab = source.config["vocab_size"]
    return {kind: ids[0].tolist() for kind, ids in judging_ids(root, vocab, eval_tokens).items()}


# ---------------------------------------------------------------- the run


def main(argv=None) -> None:
    args = parse_args(argv)
    from convert.targets.llamacpp.engine import SCRIPT, engine_python

    python = engine_python()
    if python is None:
        sys.exit(f"llama.cpp is not built: bash {SCRIPT}")
    shares = [parse_share(s) for s in args.shares.split(",")]
    types = args.types.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_contexts = [int(c) for c in args.kv_contexts.split(",") if c]
    out = args.out or _common.result_file("llamacpp", f"llamacpp_{args.model}.json")
    work = _common.RESULTS / f"llamacpp-{args.model}.tmp"  # *.tmp: git-ignored, reused by a rerun
    work.mkdir(parents=True, exist_ok=True)
    quiet = _common.wait_quiet(1.0, 300)
    contention = _common.Contention()
    result = _common.header("llamacpp", "cpu", quiet) | {"model": args.model, "files": {}, "goals": {}}
    result["flash_attn"] = os.environ.get("CONVERT_LLAMACPP_FLASH_ATTN", "1") != "0"

    files = {f"original {t}": (path, "original", t) for t, path in originals(args.model, work, types).items()}
    for share, multiple in shares:
        made, seconds = converted(args.model, work, share, types, args.calib_tokens, multiple)
        result.setdefault("convert_s", {})[share_tag(share, multiple)] = round(seconds, 1)
        files |= {f"mla {share_tag(share, multiple)} {t}": (path, (share, multiple), t) for t, path in made.items()}
    for label, (path, share, kind) in files.items():
        share, multiple = (share, None) if share == "original" else share
        result["files"][label] = {"path": path, "share": share, "latent_multiple": multiple, "type": kind,
                                  "bytes": path.stat().st_size}  # fmt: skip

    texts = judging(args.model, args.eval_tokens)
    ids_file = work / "judging.json"
    ids_file.write_text(json.dumps(texts))
    for label, (path, _, _) in files.items():
        nll, _ = engine(python, "nll", path, args.threads, ids_file)
        ppl = {kind: float(_exp_mean(values)) for kind, values in nll.items()}
        result["files"][label]["perplexity"] = ppl
        _common.write_json(out, result)
    for entry in result["files"].values():
        base = result["files"][f"original {entry['type']}"]["perplexity"]
        entry["ppl_ratio"] = {kind: entry["perplexity"][kind] / base[kind] for kind in base}

    prompt_file = work / "prompt.json"
    prompt_file.write_text(json.dumps([t for ids in texts.values() for t in ids]))
    for context in contexts:  # every file at one context, then the next: side by side
        for label, (path, _, _) in files.items():
            figures, stderr = engine(python, "speed", path, context, args.decode, args.threads, prompt_file)
            figures["kv_bytes"] = kv_bytes(stderr, context)
            figures.pop("decode_ms")
            result["files"][label].setdefault("at", {})[str(context)] = figures
            print(f"[{label} @ {context}] {figures}", file=sys.stderr, flush=True)
            _common.write_json(out, result)

    for context in kv_contexts:
        for label, (path, _, _) in files.items():
            _, stderr = engine(python, "kv", path, context)
            result["files"][label].setdefault("at", {}).setdefault(str(context), {})["kv_bytes"] = kv_bytes(
                stderr, context
            )
        _common.write_json(out, result)

    result["lines"] = lines(args.model, result["files"], contexts, kv_contexts)
    result["goals"] = goals(result["files"], contexts, kv_contexts)
    result["contention"] = contention.report()
    _common.write_json(out, result)
    print(report_table(result["files"], contexts, kv_contexts))
    print("\n".join(result["lines"]))
    for name, goal in result["goals"].items():
        print(f"goal {name}: {goal['value']} ({goal['bound']}) {'met' if goal['met'] else 'MISSED'}")
    plot(result["files"], contexts, kv_contexts, out.with_suffix(".png"), args.model)
    print(_common.contention_line(result["contention"]))


def _exp_mean(values: list[float]) -> float:
    import math

    return math.exp(sum(values) / len(values))


def _ratio(files: dict, label: str, context: int, key: str) -> float:
    entry = files[label]
    base = files[f"original {entry['type']}"]
    return entry["at"][str(context)][key] / base["at"][str(context)][key]


def lines(model: str, files: dict, contexts: list[int], kv_contexts: list[int]) -> list[str]:
    """One line per figure: `<model> <figure>_<context>_<share>_<type> <value>`."""
    out = []
    for label, entry in files.items():
        if entry["share"] == "original":
            continue
        tag = f"{entry['share']:g}_{entry['type']}"
        tag += "" if entry.get("latent_multiple") is None else f"_m{entry['latent_multiple']}"
        for context in sorted({*contexts, *kv_contexts}):
            out.append(f"{model} kv_ratio_{context}_{tag} {_ratio(files, label, context, 'kv_bytes'):.3f}")
            if context in contexts:
                out.append(f"{model} decode_ratio_{context}_{tag} {_ratio(files, label, context, 'decode_tok_s'):.3f}")
        worst = max(entry["ppl_ratio"].values())
        out.append(f"{model} worst_ppl_ratio_{tag} {worst:.3f}")
    return out


def goals(files: dict, contexts: list[int], kv_contexts: list[int]) -> dict:
    """The issue's goals on what was measured: KV at the longest context at 25% ≤ 0.27× the original's;
    decode at 8K and 32K at 25% at least the original's; the full latent within ×1.05 on every kind
    (F16); Q4_K_M's ratio within 0.02 of F16's, each share (files without --latent-multiple)."""
    out, longest = {}, max([*contexts, *kv_contexts])
    for label, entry in files.items():
        share, kind = entry["share"], entry["type"]
        if share == "original" or entry.get("latent_multiple") is not None:
            continue
        if share == 0.25:
            value = _ratio(files, label, longest, "kv_bytes")
            out[f"kv_{longest}_{kind}"] = {"value": round(value, 3), "bound": f"≤ {GOAL_KV_AT_25}",
                                           "met": value <= GOAL_KV_AT_25}  # fmt: skip
            for context in (c for c in contexts if c >= 8192):
                value = _ratio(files, label, context, "decode_tok_s")
                out[f"decode_{context}_{kind}"] = {"value": round(value, 3), "bound": "≥ 1", "met": value >= 1}
        if share == 1 and kind == "F16":
            worst = max(entry["ppl_ratio"].values())
            out["full_latent_ppl_F16"] = {"value": round(worst, 3), "bound": f"≤ {GOAL_FULL_PPL}",
                                          "met": worst <= GOAL_FULL_PPL}  # fmt: skip
        if kind == "Q4_K_M" and f"mla {share:g} F16" in files:
            f16 = files[f"mla {share:g} F16"]["ppl_ratio"]
            delta = max(abs(entry["ppl_ratio"][k] - f16[k]) for k in f16)
            out[f"q4_vs_f16_{share:g}"] = {"value": round(delta, 3), "bound": f"≤ {GOAL_Q4_DELTA}",
                                           "met": delta <= GOAL_Q4_DELTA}  # fmt: skip
    return out


def report_table(files: dict, contexts: list[int], kv_contexts: list[int]) -> str:
    every = sorted({*contexts, *kv_contexts})
    headers = ["file", "MB", *(f"KV MiB @{c}" for c in every), *(f"decode tok/s @{c}" for c in contexts),
               *(f"prompt tok/s @{c}" for c in contexts), "worst ppl ×"]  # fmt: skip
    rows = []
    for label, entry in files.items():
        at = entry.get("at", {})
        rows.append([
            label, entry["bytes"] / 1e6,
            *(at.get(str(c), {}).get("kv_bytes", 0) / 2**20 for c in every),
            *(at.get(str(c), {}).get("decode_tok_s") for c in contexts),
            *(at.get(str(c), {}).get("prompt_tok_s") for c in contexts),
            max(entry["ppl_ratio"].values()),
        ])  # fmt: skip
    return _common.table(headers, rows)


def plot(files: dict, contexts: list[int], kv_contexts: list[int], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kv, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for label, entry in files.items():
        at = entry["at"]
        style = "-" if entry["share"] == "original" else "--"
        every = sorted({*contexts, *kv_contexts})
        kv.plot(every, [at[str(c)]["kv_bytes"] / 2**20 for c in every], style, marker="o", label=label)
        speed.plot(contexts, [at[str(c)]["decode_tok_s"] for c in contexts], style, marker="o", label=label)
    for ax, title in ((kv, "KV cache (MiB, llama.cpp's log)"), (speed, "decode tokens/s at that context")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    kv.set_yscale("log")
    speed.legend(fontsize=7)
    fig.suptitle(f"{model} in llama.cpp: original GGUF vs --target llamacpp")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
