"""Where Q4_K_M loses a converted file's quality in llama.cpp (issue 66): one of bench/llamacpp.py's
deepseek2 files (F16) quantized by llama.cpp's own quantizer with its Q4_K_M mix as it is, and with
some tensors given other types (llama-quantize's `--tensor-type`, `llama_model_quantize`'s
`tt_overrides`); each judged by perplexity from llama.cpp's own logits on the shipped held-out text of
every kind, its ratio to the original Q4_K_M's against the F16 file's ratio to the original F16's
(the goal: within 0.02).

Q4_K_M gives the original's `attn_v` (and `ffn_down`) Q6_K in about half the layers (llama-quant.cpp,
`use_more_bits`); a deepseek2 file's latent tensors (`attn_kv_a_mqa`, `attn_k_b`, `attn_v_b`) have no
rule, so they get the mix's 4-5 bits (Q4_K, or Q5_0 where a row is not a multiple of 256) unless overridden.

    python bench/llamacpp_quant.py [--model smollm2] [--share 0.5] [--variants all] [--eval-tokens 1024]

Reuses bench/llamacpp.py's work folder (the originals and the converted file; converted if absent).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import llamacpp  # noqa: E402


def more_bits_layers(n_layers: int) -> list[int]:
    """The layers llama.cpp's Q4_K_M gives Q6_K in `attn_v` and `ffn_down` (`use_more_bits`)."""
    return [i for i in range(n_layers) if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2]


def variants(n_layers: int) -> dict[str, list[tuple[str, str]]]:
    """Named override sets: (regex over GGUF tensor names, ggml type). "latent Q8_0" is what
    `--gguf-type Q4_K_M` ships (`QUANT_OVERRIDES`); the others vary it."""
    from convert.targets.llamacpp import QUANT_OVERRIDES

    shipped = QUANT_OVERRIDES["Q4_K_M"]
    ((latent, _),) = shipped  # the latent's three tensors
    layers = "|".join(map(str, more_bits_layers(n_layers)))
    return {
        "Q4_K_M": [],
        "latent Q8_0": shipped,
        "latent F16": [(latent, "F16")],
        # a row not a multiple of 256 values (SmolLM2's 576-wide attn_kv_a_mqa, every k_b / v_b): Q8_0 instead
        "latent Q6_K": [(latent, "Q6_K")],
        "kv_a Q8_0": [(r"attn_kv_a_mqa", "Q8_0")],
        "k_b,v_b Q8_0": [(r"attn_k_b|attn_v_b", "Q8_0")],
        "q,output Q8_0": [(r"attn_q\.|attn_output", "Q8_0")],
        "value path as attn_v": [(rf"blk\.({layers})\.(attn_kv_a_mqa|attn_v_b)\.", "Q6_K")],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("smollm2", "qwen25coder"), default="smollm2")
    p.add_argument("--share", default="0.5", help="the converted file's --kv-cache-ratio share (SHARE[/N])")
    p.add_argument("--variants", default="all", help="comma-separated names of `variants` (default all)")
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from convert.targets.llamacpp import quantize
    from convert.targets.llamacpp.engine import SCRIPT, engine_python

    python = engine_python()
    if python is None:
        sys.exit(f"llama.cpp is not built: bash {SCRIPT}")
    work = _common.RESULTS / f"llamacpp-{args.model}.tmp"
    work.mkdir(parents=True, exist_ok=True)
    share, multiple = llamacpp.parse_share(args.share)
    out = args.out or _common.result_file("llamacpp_quant", f"llamacpp_quant_{args.model}_{share:g}.json")
    quiet = _common.wait_quiet(1.0, 300)
    originals = llamacpp.originals(args.model, work, ["F16", "Q4_K_M"])
    made, _ = llamacpp.converted(args.model, work, share, ["F16"], None, multiple)
    n_layers = json.loads((made["F16"].parent / "config.json").read_text())["num_hidden_layers"]
    chosen = variants(n_layers)
    if args.variants != "all":
        chosen = {name: chosen[name] for name in args.variants.split(",")}
    texts = llamacpp.judging(args.model, args.eval_tokens)
    ids_file = work / f"judging-{args.eval_tokens}.json"
    ids_file.write_text(json.dumps(texts))

    def perplexity(path: Path) -> dict[str, float]:
        nll, _ = llamacpp.engine(python, "nll", path, args.threads, ids_file)
        return {kind: llamacpp._exp_mean(values) for kind, values in nll.items()}

    result = _common.header("llamacpp_quant", "cpu", quiet) | {
        "model": args.model, "share": args.share, "file": str(made["F16"]), "eval_tokens": args.eval_tokens,
        "layers_with_more_bits": more_bits_layers(n_layers), "variants": {},
    }  # fmt: skip
    base = {label: perplexity(path) for label, path in originals.items()}
    f16 = perplexity(made["F16"])
    result["f16_ratio"] = {kind: f16[kind] / base["F16"][kind] for kind in f16}
    for name, overrides in chosen.items():
        path = work / f"quant-{share:g}-{name.replace(' ', '_').replace(',', '+')}.gguf"
        quantize(made["F16"], path, "Q4_K_M", overrides)
        ppl = perplexity(path)
        ratio = {kind: ppl[kind] / base["Q4_K_M"][kind] for kind in ppl}
        delta = max(abs(ratio[kind] - result["f16_ratio"][kind]) for kind in ratio)
        result["variants"][name] = {"overrides": overrides, "bytes": path.stat().st_size, "ratio": ratio,
                                    "delta_vs_f16": delta}  # fmt: skip
        path.unlink()  # ours: made just above
        print(f"[{name}] delta {delta:.3f} {json.dumps(ratio)}", file=sys.stderr, flush=True)
        _common.write_json(out, result)
    kinds = list(result["f16_ratio"])
    rows = [["F16 (reference)", made["F16"].stat().st_size / 1e6, *(result["f16_ratio"][k] for k in kinds), None]]
    for name, entry in result["variants"].items():
        rows.append([name, entry["bytes"] / 1e6, *(entry["ratio"][k] for k in kinds), entry["delta_vs_f16"]])
    print(_common.table(["file", "MB", *(f"× {k}" for k in kinds), "max |Δ| vs F16"], rows))


if __name__ == "__main__":
    main()
