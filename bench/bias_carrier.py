"""How constant the bias carrier's direction stays on text it was not fitted on.

The vllm and llamacpp exports carry attention biases on a direction `a` of each layer's normed inputs with
`aᵀx ≈ 1` (`convert.targets.vllm.bias.BiasCarrier`: least squares on the calibration text, a = M⁻¹μ). What
a carried bias gets wrong is `(1 − aᵀx)·b` per token, so E[(1 − aᵀx)²] is its error's share. This measures
it for the first `--layers` layers of a real model (cut to them: `fixtures/realdata.first_layers`) on the
calibration the exports use by default (the shipped mix, `--calib-tokens`) and on the held-out part of every
kind of text, for several ridge strengths (the package's `ridge` is 1e-6 of the mean diagonal) and, for the
first layer, for directions fitted on the whole vocabulary (its inputs are the normed embedding rows, so such
a fit sees every input it will meet), rows weighted by the calibration's token counts plus `smooth` of their
mean.

    python bench/bias_carrier.py --model qwen15b          # bench/results/bias_carrier/bias_carrier_qwen15b.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import _common
import torch
from every_path import MODELS

RIDGES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1)
SMOOTHS = (1.0, 0.1, 0.01)


def layer_inputs(model, ids: torch.Tensor, window: int = 1024) -> dict[int, torch.Tensor]:
    """{layer: its attention's normed inputs (N, D) float64} over `ids` (1, N) in windows."""
    got: dict[int, list] = {i: [] for i in range(len(model.model.layers))}

    def store(i: int):
        return lambda _module, _args, kwargs: got[i].append(kwargs["hidden_states"][0])

    hooks = [
        layer.self_attn.register_forward_pre_hook(store(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for start in range(0, max(ids.shape[1] - window, 0) + 1, window):
            model(ids[:, start : start + window])
    for hook in hooks:
        hook.remove()
    return {i: torch.cat(v).double() for i, v in got.items()}


def stray(direction: torch.Tensor, x: torch.Tensor) -> float:
    """E[(1 − aᵀx)²] over the rows of x."""
    return float(((1 - x @ direction) ** 2).mean())


def fitted(moment: torch.Tensor, mean: torch.Tensor, rel: float) -> torch.Tensor:
    """a = (M + rel·mean(diag M)·I)⁻¹ μ."""
    return torch.linalg.solve(
        moment + rel * moment.diagonal().mean() * torch.eye(len(moment), dtype=moment.dtype), mean
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen15b")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="default bench/results/bias_carrier/bias_carrier_MODEL.json")
    args = p.parse_args()
    import realdata
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convert.text import calibration_ids

    src = Path(MODELS[args.model](realdata))
    tokenizer = AutoTokenizer.from_pretrained(src)
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        realdata.first_layers(src, Path(tmp) / "cut", args.layers)
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "cut", dtype=torch.float32).eval()
    source = SimpleNamespace(root=src, config={"vocab_size": model.config.vocab_size})
    ids = calibration_ids(source, SimpleNamespace(calib=None, calib_tokens=args.calib_tokens))
    calib = layer_inputs(model, ids)
    held = {}
    for kind in realdata.TEXT_KINDS:
        text = realdata.text_kind(kind, "eval", tokenizer)
        held[kind] = layer_inputs(
            model, torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][: args.eval_tokens]])
        )
    rows = []

    def row(layer: int, fit: str, direction: torch.Tensor) -> None:
        r = {"layer": layer, "fit": fit, "calibration": stray(direction, calib[layer])}
        r |= {kind: stray(direction, held[kind][layer]) for kind in held}
        rows.append(r)
        print(
            f"layer {layer} {fit}: " + " ".join(f"{k} {v:.2e}" for k, v in r.items() if isinstance(v, float)),
            flush=True,
        )

    for layer, x in calib.items():
        moment, mean = x.T @ x / len(x), x.mean(0)
        for rel in RIDGES:
            row(layer, f"calibration, ridge {rel:g}", fitted(moment, mean, rel))
    embedding = model.model.embed_tokens.weight.detach().double()  # (V, D)
    norm = model.model.layers[0].input_layernorm
    vocab_x = (
        norm.weight.detach().double()
        * embedding
        / (embedding.pow(2).mean(1, keepdim=True) + norm.variance_epsilon).sqrt()
    )
    counts = torch.bincount(ids[0], minlength=len(embedding)).double()
    for smooth in SMOOTHS:
        weight = counts + smooth * counts.mean()
        moment = (vocab_x.T * weight) @ vocab_x / weight.sum()
        row(0, f"vocabulary, smooth {smooth:g}", fitted(moment, vocab_x.T @ weight / weight.sum(), 1e-6))
    result = _common.header("bias_carrier", "cpu", {}) | {"model": args.model, "calib_tokens": ids.shape[-1]}
    result |= {"eval_tokens": args.eval_tokens, "rows": rows}
    _common.write_json(
        args.out or _common.result_file("bias_carrier", f"bias_carrier_{args.model.replace('-', '_')}.json"), result
    )
    kinds = ["calibration", *held]
    print(
        _common.table(["layer", "fit", *kinds], [[r["layer"], r["fit"], *(f"{r[k]:.2e}" for k in kinds)] for r in rows])
    )


if __name__ == "__main__":
    main()
