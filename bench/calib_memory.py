"""Peak memory and time of the Fisher calibration pass: the whole model's, with a whole-window
loss or a chunked one, against the streamed pass `convert gqa2mla` runs (one decoder layer at a
time, `fisher_calibrate_streamed`).

The Fisher statistics need one backward pass of the whole model per calibration window.
With a large vocabulary the loss dominates: (window × vocab) logits, their log-softmax and
gradients (Gemma 3: 1,024 × 262,144 float32 = 1 GiB each). `summed_loss` computes it in
chunks of `LOSS_CHUNK` tokens recomputed in the backward pass. Each setting runs in its own
process (peak RSS is per process), side by side in one invocation; `--chunks` value 0 is the
streamed pass (its peak includes only what it reads from the checkpoint, no whole model):

    python bench/calib_memory.py                  # Gemma 3 270M, 4,096 tokens of Pride and Prejudice
    python bench/calib_memory.py --model smollm2
"""

import argparse
import importlib
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import realdata  # noqa: E402

MODELS = {"gemma3": realdata.gemma3_dir, "smollm2": realdata.smollm2_dir}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gemma3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument(
        "--chunks", default="1024,128,0", help="loss chunks to compare (the window: whole-window loss; 0: streamed)"
    )
    p.add_argument("--out", type=Path, default=None, help="default bench/results/calib_memory/calib_memory_MODEL.json")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    """One Fisher pass with LOSS_CHUNK = args.child; prints its figures as JSON."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calibrate = importlib.import_module("convert.compress.calibrate")  # the module, not the function

    src = MODELS[args.model]()
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = torch.tensor(tokenizer(realdata.austen_text("prideprejudice"))["input_ids"][: args.tokens])[None]
    if args.child == 0:  # streamed, from the checkpoint
        from convert.io import open_checkpoint

        config = json.loads((Path(src) / "config.json").read_text())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = time.perf_counter()
        with open_checkpoint(src) as checkpoint:
            n_layers = config["num_hidden_layers"]
            run = calibrate.CalibrationRun(window=args.window)
            stats = calibrate.fisher_calibrate_streamed(checkpoint, config, ids, n_layers, run)
        seconds = time.perf_counter() - start
        vocab = config["vocab_size"]
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        calibrate.LOSS_CHUNK = args.child
        start = time.perf_counter()
        stats = calibrate.fisher_calibrate(model, ids, window=args.window)
        seconds = time.perf_counter() - start
        vocab = model.config.vocab_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    key_trace = sum(float(s.key_fisher.trace()) for s in stats)  # the same statistics either way
    print(
        json.dumps(
            {
                "chunk": args.child,
                "peak_rss": peak,
                "rss_before_pass": before,
                "seconds": seconds,
                "key_fisher_trace": key_trace,
                "vocab": vocab,
                "mode": "streamed" if args.child == 0 else "whole model",
            }
        )
    )


def main(argv=None):
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    from _common import result_file, source_commit  # bench/ is on the path of a script run from it

    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        command = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens)]
        command += ["--window", str(args.window), "--child", str(chunk)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{'streamed' if chunk == 0 else f'chunk {chunk:5d}'}: peak RSS {row['peak_rss'] / 2**30:.2f} GiB "
            f"(model loaded: {row['rss_before_pass'] / 2**30:.2f} GiB), {row['seconds']:.0f} s",
            flush=True,
        )
    result = {
        "model": args.model,
        "tokens": args.tokens,
        "window": args.window,
        "rows": rows,
        "machine": {"python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]),
        "commit": source_commit(),
    }
    out = args.out or result_file("calib_memory", f"calib_memory_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
