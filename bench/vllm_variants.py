"""Variants of the vllm target's position-free (NoPE) terms on SmolLM2, transformers DeepseekV3
only (no vLLM): fit (the default: the least-squares stand-in for the dropped rotations on key
samples drawn from the attention probabilities, convert.targets.vllm.nope_fit; 32 keys per query,
the default, and 16), nope (unrotated), drop, expected (E[cos] over a span).

Calibrates on Pride and Prejudice (4096 tokens), measures perplexity ratio against the
original on a DEV text (Persuasion, 2048 tokens; not the held-out Emma of
bench/vllm_target.py), so the choice is not tuned on the evaluation text.

    python bench/vllm_variants.py
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
import _common
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from convert.compress.calibrate import calibrate
from convert.io import open_checkpoint
from convert.targets.vllm import ExportChoices, match_vllm_norms, to_vllm_deepseek
from convert.targets.vllm.calibration import rotation_fit_observer
from convert.targets.vllm.export import resolve_vllm_spec
from convert.targets.vllm.nope_fit import SAMPLES
from convert.text import text_token_ids
from convert.verify.e2e import perplexity

torch.set_num_threads(2)
src = _common.smollm2_dir()
config = json.loads((src / "config.json").read_text())
dev = text_token_ids(_common.austen_file("persuasion"), src, config["vocab_size"], 2048)
cal = text_token_ids(_common.austen_file("prideprejudice"), src, config["vocab_size"], 4096)
with open_checkpoint(src) as ck:
    sd = {n: ck.get(n) for n in ck.keys()}
    _, view, spec = resolve_vllm_spec(sd, config)
    stats = {
        samples: calibrate(
            ck, config, cal, config["num_hidden_layers"], observe=rotation_fit_observer(view, spec, config, samples)
        )
        for samples in (SAMPLES, 16)
    }
orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()


def ppl(m):
    return perplexity(m, dev, window=dev.shape[-1])  # one window, as the runs so far


p0 = ppl(orig)
results = []
variants = [("fit", 0, SAMPLES), ("fit", 0, 16), ("nope", 0, 0), ("drop", 0, 0)]
variants += [("expected", span, 0) for span in (64, 256, 1024)]
for mode, span, samples in variants:
    choices = ExportChoices(stats=stats[samples or SAMPLES], stand_in=mode, span=max(span, 1))
    t, c = to_vllm_deepseek(sd, config, choices)
    c.pop("convert_export")
    m = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(c)).eval()
    m.load_state_dict(t, strict=False)
    match_vllm_norms(m)
    results.append({"stand_in": mode, "span": span, "samples": samples, "ppl_ratio_dev": ppl(m) / p0})
    print(results[-1], flush=True)
_common.write_json(
    _common.result_file("vllm_variants", "vllm_variants_smollm2.json"),
    {
        "command": _common.command_line(),
        "dev_book": "persuasion",
        "calib_book": "prideprejudice",
        "ppl_original_dev": p0,
        "variants": results,
    },
)
