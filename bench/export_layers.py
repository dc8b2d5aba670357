"""Where a vllm (DeepSeek-V3) or llamacpp (deepseek2 GGUF) export departs from its source, layer by layer:
the relative error of each decoder layer's attention output and hidden state, the export's divided by its
residual scale.

The source is a real model cut to its first `--layers` decoder layers (real weights and vocabulary; a
perplexity of so few layers says nothing, their outputs do), exported by `convert gqa2mla --target vllm
--no-verify` in a child process, both run by stock transformers in float32 on the first 256 tokens of the
held-out code text. `--zero-biases q,k,v` zeroes those attention biases in the cut first (source and
export alike): how much of the error is the biases' and how much the rest of the export's. `--target
llamacpp` reads the GGUF as llama.cpp computes it (`convert.targets.llamacpp.load`, float32 file).

    python bench/export_layers.py --model qwen15b --layers 2
    python bench/export_layers.py --model qwen15b --layers 2 --zero-biases q,k,v
    python bench/export_layers.py --model qwen15b --convert-args "--calib-tokens 2048 --fisher-tokens 1024"
    python bench/export_layers.py --model qwen15b --target llamacpp --convert-args "--gguf-type F32"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _common
import torch
from every_path import MODELS


def layer_outputs(directory: Path, ids: torch.Tensor, target: str = "transformers") -> dict:
    """{("attention" | "layer", i): output (1, L, D)} of each decoder layer of the model in `directory`
    (`target` llamacpp: its GGUF as llama.cpp computes it)."""
    from transformers import AutoModelForCausalLM

    if target == "llamacpp":
        from convert.targets.llamacpp import load

        model = load(directory, "cpu", torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        store = lambda key: lambda _m, _a, out: outputs.__setitem__(key, (out[0] if isinstance(out, tuple) else out))
        hooks.append(layer.self_attn.register_forward_hook(store(("attention", i))))
        hooks.append(layer.register_forward_hook(store(("layer", i))))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen15b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--target", choices=("vllm", "llamacpp"), default="vllm")
    p.add_argument("--zero-biases", default="", help="comma-separated of q,k,v: zeroed in the cut")
    p.add_argument(
        "--convert-args", default="", help='more gqa2mla options, e.g. "--calib-tokens 2048 --fisher-tokens 1024"'
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default bench/results/export_layers/export_layers_MODEL[_llamacpp][_nobias].json",
    )
    args = p.parse_args()
    import realdata
    from transformers import AutoTokenizer

    zero = "".join(args.zero_biases.split(","))
    src = Path(MODELS[args.model](realdata))
    ids = torch.tensor([AutoTokenizer.from_pretrained(src)(realdata.text_kind("code"))["input_ids"][:256]])
    rows = []
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        source, export = Path(tmp) / "cut", Path(tmp) / "export"
        realdata.first_layers(src, source, args.layers, zero)
        command = [sys.executable, "-m", "convert", "gqa2mla", str(source), "-o", str(export), "--target", args.target]
        subprocess.run([*command, "--no-verify", "-q", *args.convert_args.split()], check=True, cwd=_common.REPO)
        record = json.loads((export / "config.json").read_text())["convert_export"]
        scale = record["residual_scale"] * 2.0 ** record.get("residual_scale_log2", 0)  # llamacpp: × 2^-k more
        want, got = layer_outputs(source, ids), layer_outputs(export, ids, args.target)
        for key in sorted(want, key=lambda k: (k[1], k[0])):
            a, b = want[key].double(), got[key].double() / scale
            rows.append({"what": key[0], "layer": key[1], "rel_error": float((a - b).norm() / a.norm())})
            print(f"{args.model} layer {key[1]} {key[0]} rel_error {rows[-1]['rel_error']:.3f}", flush=True)
    result = _common.header("export_layers", "cpu", {}) | {"model": args.model, "target": args.target}
    result |= {"zero_biases": list(zero), "rows": rows}
    result["convert_args"] = args.convert_args
    name = f"export_layers_{args.model.replace('-', '_')}" + ("_llamacpp" if args.target == "llamacpp" else "")
    name += "_nobias" if zero else ""
    _common.write_json(args.out or _common.result_file("export_layers", f"{name}.json"), result)
    print(_common.table(["layer", "output", "relative error"], [[r["layer"], r["what"], r["rel_error"]] for r in rows]))


if __name__ == "__main__":
    main()
