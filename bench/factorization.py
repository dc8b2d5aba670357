#!/usr/bin/env python3
"""Per-layer factorization time on SmolLM2-135M: the seed's way against ours.

For every layer's k_proj and v_proj (G·d × D = 192 × 576, float32 on disk,
factored in float64), each method produces the same thing, the up factor of
every query head (H·d × r, r = G·d) and the down factor (r × D):

  seed-torch   build the tiled H·d × D matrix W̃ (576 × 576), torch.linalg.svd
               (full_matrices=False), keep r: U[:, :r], diag(S[:r]) Vᵀ[:r]
  seed-numpy   the seed's Part 10 literally: W̃ built in numpy, np.linalg.svd(W̃)
               (full_matrices=True, numpy's default), the same slicing
  real_factor  ours: convert.linalg.real_factor on the G·d × D matrix (since
               commit 541da1b an eigendecomposition of the G·d × G·d Gram
               matrix W Wᵀ, before it a reduced SVD), then expand_groups of the
               up factor (rows per query head)
  rope_factor  ours, keys of the absorbed layout: the per-frequency complex
               latent (convert.linalg.rope_factor), then expand_groups

W̃ uses the model's head map (grouped, h // (H/G)); the seed's "concatenate
H/G copies" is the tiled map, a row permutation of the same cost. Timed: from
the float32 weight to both factors. Each repeat runs every layer, and per
layer every method in an order that rotates (interleaved). Reconstruction:
max |up·down − W̃| per method and the max difference between the seed's and
our reconstructions, all in float64. For real_factor also: its singular
values against torch.linalg.svdvals (max relative difference) and, truncated
to r/2, its Frobenius error over the optimal (Eckart–Young) one, since a Gram
matrix squares the condition number.

    python bench/factorization.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser, "factorization")
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all 30)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from safetensors import safe_open

    from convert.linalg import expand_groups, real_factor, rope_factor, tile_rows

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    src = C.smollm2_dir()
    import json

    config = json.loads((src / "config.json").read_text())
    H, G = config["num_attention_heads"], config["num_key_value_heads"]
    D = config["hidden_size"]
    d = config.get("head_dim") or D // H
    r = G * d
    n_layers = args.layers or config["num_hidden_layers"]
    groups = (torch.arange(H) // (H // G)).numpy()  # grouped head map
    head_map = "grouped"

    weights = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for i in range(n_layers):
            for p in ("k", "v"):
                weights[(i, p)] = f.get_tensor(f"model.layers.{i}.self_attn.{p}_proj.weight").clone()

    def seed_torch(w):
        tilde = tile_rows(w.double(), H, G, head_map)  # (H·d, D)
        u, s, vh = torch.linalg.svd(tilde, full_matrices=False)
        return u[:, :r], s[:r, None] * vh[:r]

    def seed_numpy(w):
        w_np = w.numpy().astype(np.float64)
        tilde = w_np.reshape(G, d, D)[groups].reshape(H * d, D)
        u, s, vh = np.linalg.svd(tilde)  # the seed: full_matrices=True
        return u[:, :r], s.reshape(-1, 1)[:r, :] * vh[:r, :]

    def ours_real(w):
        f = real_factor(w)
        return expand_groups(f.up, H, G, head_map), f.down

    def ours_rope(w):
        f = rope_factor(w, G)
        return expand_groups(f.up, H, G, head_map), f.down

    methods = {
        "k": {"seed-torch": seed_torch, "seed-numpy": seed_numpy, "real_factor": ours_real, "rope_factor": ours_rope},
        "v": {"seed-torch": seed_torch, "seed-numpy": seed_numpy, "real_factor": ours_real},
    }

    # Reconstruction (untimed).
    recon = {}
    for p, ms in methods.items():
        for name, fn in ms.items():
            worst, worst_rel, worst_vs_seed = 0.0, 0.0, 0.0
            for i in range(n_layers):
                w = weights[(i, p)]
                tilde = tile_rows(w.double(), H, G, head_map)
                up, down = fn(w)
                up, down = torch.as_tensor(up), torch.as_tensor(down)
                rec = up @ down
                ref = seed_torch(w)
                rec_seed = ref[0] @ ref[1]
                worst = max(worst, float((rec - tilde).abs().max()))
                worst_rel = max(worst_rel, float((rec - tilde).norm() / tilde.norm()))
                worst_vs_seed = max(worst_vs_seed, float((rec - rec_seed).abs().max()))
            recon[f"{p}:{name}"] = {
                "max_abs_error": worst,
                "max_rel_frobenius_error": worst_rel,
                "max_abs_diff_vs_seed_torch": worst_vs_seed,
                "weight_max_abs": max(float(weights[(i, p)].abs().max()) for i in range(n_layers)),
            }

    # real_factor against the SVD: singular values, and truncation to r/2.
    spectrum = {}
    for p in methods:
        worst_s, worst_trunc = 0.0, 0.0
        for i in range(n_layers):
            w = weights[(i, p)].double()
            exact_s = torch.linalg.svdvals(w)
            f = real_factor(weights[(i, p)])
            worst_s = max(worst_s, float(((f.singular_values[: exact_s.numel()] - exact_s).abs() / exact_s).max()))
            half = real_factor(weights[(i, p)], r // 2)
            optimal = float(exact_s[r // 2 :].square().sum().sqrt())
            worst_trunc = max(worst_trunc, float((half.up @ half.down - w).norm()) / optimal)
        spectrum[p] = {
            "max_rel_singular_value_diff": worst_s,
            "max_truncated_error_over_optimal_at_r_half": worst_trunc,
        }

    # Warm-up (untimed): first calls pay for lazy LAPACK/BLAS initialisation.
    for p, ms in methods.items():
        for fn in ms.values():
            fn(weights[(0, p)])

    samples = {f"{p}:{m}": [[] for _ in range(n_layers)] for p, ms in methods.items() for m in ms}
    contention = []
    for rep in range(args.repeat):
        watch = C.Contention()
        k = 0
        for i in range(n_layers):
            for p, ms in methods.items():
                for name in C.rotate(list(ms), k):
                    fn = ms[name]
                    w = weights[(i, p)]
                    t0 = time.perf_counter()
                    fn(w)
                    samples[f"{p}:{name}"][i].append(time.perf_counter() - t0)
                k += 1
        contention.append(watch.report())
        print(
            f"repeat {rep + 1}/{args.repeat} done; other processes used {contention[-1]['other_cpu_cores']} cores",
            flush=True,
        )

    per_layer = {key: [C.median(s) for s in layers] for key, layers in samples.items()}
    summary = {}
    for key, meds in per_layer.items():
        p, name = key.split(":")
        seed = per_layer[f"{p}:seed-torch"]
        summary[key] = {
            "median_per_layer_s": C.median(meds),
            "all_layers_s": sum(meds),
            "ratio_seed_torch_over_this": C.median([a / b for a, b in zip(seed, meds)]),
            "ratio_seed_numpy_over_this": C.median([a / b for a, b in zip(per_layer[f"{p}:seed-numpy"], meds)]),
        }

    rows = []
    for key, s in summary.items():
        p, name = key.split(":")
        rec = recon[key]
        rows.append(
            [
                f"{p}_proj",
                name,
                s["median_per_layer_s"] * 1e3,
                s["all_layers_s"],
                s["ratio_seed_torch_over_this"],
                s["ratio_seed_numpy_over_this"],
                rec["max_abs_error"],
                rec["max_abs_diff_vs_seed_torch"],
            ]
        )
    print(
        f"\n### Factorization per layer, SmolLM2-135M (H={H}, G={G}, d={d}, D={D}; tiled {H * d}×{D} vs {G * d}×{D}; "
        f"float64; {n_layers} layers, medians of {args.repeat})\n"
    )
    print(
        C.table(
            [
                "proj",
                "method",
                "ms / layer",
                f"all {n_layers} layers s",
                "seed-torch / this",
                "seed-numpy / this",
                "max abs(up·down − W̃)",
                "max abs(rec − rec of seed-torch)",
            ],
            rows,
        )
    )
    for p, sp in spectrum.items():
        print(
            f"\n{p}_proj real_factor vs SVD: singular values max rel. diff {sp['max_rel_singular_value_diff']:.2e}; "
            f"truncated to r/2 = {r // 2}: error / optimal error ≤ {sp['max_truncated_error_over_optimal_at_r_half']:.12f}"
        )
    run = whole_run.report()
    print("\n" + C.contention_line(run))

    data = C.header("factorization", "cpu", quiet)
    data.update(
        {
            "geometry": {"H": H, "G": G, "d": d, "D": D, "r": r, "layers": n_layers, "head_map": head_map},
            "repeat": args.repeat,
            "samples_s": samples,
            "per_layer_median_s": per_layer,
            "summary": summary,
            "reconstruction": recon,
            "real_factor_vs_svd": spectrum,
            "numpy": np.__version__,
            "contention_per_repeat": contention,
            "contention": run,
        }
    )
    C.write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
