"""What holding the slowest RoPE frequencies still costs SmolLM2-135M, before any compression.

`--nope-angle A` caches the key frequencies that turn less than A radians over
min(max_position_embeddings, 4096) tokens as NoPE dims (unrotated). This sets those
frequencies of the original model's own rotary embedding to zero (`inv_freq`) and measures
its perplexity on 4,096 tokens of *Emma* (windows of 1,024), for each angle:

    python bench/static_freqs.py                       # angles 0.75, 2, 3, 5, 13
    python bench/static_freqs.py --angles 3 --eval-book persuasion
"""

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import realdata  # noqa: E402

from convert.compress import STATIC_SPAN, held_frequencies  # noqa: E402
from convert.verify.e2e import perplexity  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--angles", default="0.75,2,3,5,13")
    p.add_argument("--eval-book", default="emma")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = realdata.smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer(realdata.austen_text(args.eval_book))["input_ids"][: args.eval_tokens])[None]
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()  # (d/2,)
    span = min(model.config.max_position_embeddings, STATIC_SPAN)
    base = perplexity(model, ids, args.window)
    print(f"original perplexity on {args.eval_book} ({ids.shape[-1]} tokens): {base:.4f}")
    for angle in (float(a) for a in args.angles.split(",")):
        static = list(held_frequencies(inv_freq, span, angle))  # what --nope-angle caches as NoPE
        rotary.inv_freq = inv_freq.clone()
        rotary.inv_freq[static] = 0.0
        ppl = perplexity(model, ids, args.window)
        print(f"--nope-angle {angle:g}: {len(static)} of {len(inv_freq)} frequencies held, ppl ×{ppl / base:.4f}")
    rotary.inv_freq = inv_freq


if __name__ == "__main__":
    main()
