"""The vllm target's latent compressed below what it needs, on SmolLM2 (transformers DeepseekV3
on the export, no vLLM): the regime every 7B+ source is in (Mistral-7B: 512 of the 1,984 dims
its position-free keys and values need, 26%), measured where a real model is at hand.

SmolLM2 needs 320 latent dims (128 remainder + 192 values); the export is given 100 / 75 / 50 /
25% of them (`ExportChoices(rank=…)`), the latent factored with Fisher weights (the API's
choice when it compresses), on the original model's inputs or sequentially (each layer on the
inputs the export's own earlier layers give it, up-projections refit to the original's keys and
values), and with plain activation whitening. Calibrates on Pride and
Prejudice (4096 tokens), perplexity ratio against the original on a DEV text (Persuasion,
2048 tokens). With --refine-steps N each compressed layer's attention is then fitted to the
original layer's attention output (`--refine-steps`, `convert.compress.refine`).

    python bench/vllm_latent.py
    python bench/vllm_latent.py --calib A.txt --eval-text B.txt --shares 0.25,0.5 --refine-steps 0,50

prints one line per variant and share, `share 0.25 ppl_ratio 1.234`, besides the JSON rows.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "bench")
import _common
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from convert.compress.refine import Refinement
from convert.io import open_checkpoint
from convert.targets.vllm import ExportChoices, export_statistics, latent_sequential, match_vllm_norms, to_vllm_deepseek
from convert.targets.vllm.export import resolve_vllm_spec
from convert.targets.vllm.geometry import latent_content_rank
from convert.text import text_token_ids
from convert.verify.e2e import perplexity

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--calib", type=Path, default=None, help="calibration text (default Pride and Prejudice)")
parser.add_argument("--eval-text", type=Path, default=None, help="evaluation text (default Persuasion)")
parser.add_argument("--shares", default="1,0.75,0.5,0.25", help="shares of the latent content kept")
parser.add_argument("--refine-steps", default="0", help="attention-output refinement steps to compare (e.g. 0,50)")
parser.add_argument("--variants", default="sequential,original,whitened", help="fisher sequential/original, whitened")
parser.add_argument("--out", type=Path, default=_common.result_file("vllm_latent", "vllm_latent_smollm2.json"))
args = parser.parse_args()

torch.set_num_threads(2)
src = _common.smollm2_dir()
config = json.loads((src / "config.json").read_text())
dev_file = args.eval_text or _common.austen_file("persuasion")
calib_file = args.calib or _common.austen_file("prideprejudice")
dev = text_token_ids(dev_file, src, config["vocab_size"], 2048)
cal = text_token_ids(calib_file, src, config["vocab_size"], 4096)
t0 = time.perf_counter()
with open_checkpoint(src) as ck:
    sd = {n: ck.get(n) for n in ck.keys()}
    _, view, spec = resolve_vllm_spec(sd, config)
    stats = export_statistics(ck, config, view, spec, cal, fisher=True)
calibration_s = time.perf_counter() - t0
whitened = [type(s)(s.moment, s.mean, rotation_fit=s.rotation_fit) for s in stats]  # the Fisher rows left out
orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()


def ppl(m):
    return perplexity(m, dev, window=dev.shape[-1])  # one window, as the runs so far


p0 = ppl(orig)
need = latent_content_rank(spec)
results = []
VARIANTS = {
    "sequential": ("fisher", stats, True),
    "original": ("fisher", stats, False),
    "whitened": ("whitened", whitened, False),
}
for share in [float(x) for x in args.shares.split(",")]:
    rank = round(need * share)
    for (weighting, layer_stats, sequential), steps in (
        (VARIANTS[v], int(n)) for v in args.variants.split(",") for n in args.refine_steps.split(",")
    ):
        if share == 1.0 and (weighting == "whitened" or not sequential or steps):
            continue  # exact: no weighting involved
        t0 = time.perf_counter()
        with open_checkpoint(src) as ck:
            calibration = "sequential" if sequential else "original"
            seq = latent_sequential(ck, config, cal, calibration, Refinement(steps=steps)) if share < 1.0 else None
            t, c = to_vllm_deepseek(sd, config, ExportChoices(stats=layer_stats, rank=rank, sequential=seq))
        export_s = time.perf_counter() - t0
        export = c.pop("convert_export")
        m = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(c)).eval()
        m.load_state_dict(t, strict=False)
        match_vllm_norms(m)
        results.append(
            {
                "latent_share": share,
                "rank": rank,
                "weighting": export["latent_weighting"] or "exact",
                "calibration": export["latent_calibration"],
                "refine_steps": export.get("latent_refine_steps", 0),
                "export_s": export_s,
                "ppl_ratio_dev": ppl(m) / p0,
            }
        )
        print(results[-1], flush=True)
        print(f"share {share:g} ppl_ratio {results[-1]['ppl_ratio_dev']:.3f}", flush=True)
_common.write_json(
    args.out,
    {
        "command": _common.command_line(),
        "dev_book": str(args.eval_text or "persuasion"),
        "calib_book": str(args.calib or "prideprejudice"),
        "calib_tokens": cal.shape[-1],
        "latent_content_dims": need,
        "calibration_s": calibration_s,
        "ppl_original_dev": p0,
        "results": results,
    },
)
