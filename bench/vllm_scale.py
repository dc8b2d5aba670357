"""The vllm target at Llama-3-8B's shape: wall time and peak memory of one `convert gqa2mla
--target vllm` process on a synthetic checkpoint (random bfloat16 weights, `--layers N`
decoder layers of the real shape: 32 query heads, 8 key/value heads of d = 128, D = 4,096,
llama3 RoPE, vocabulary 128,256), calibrated on an Austen novel (UTF-8 bytes: the synthetic
model has no tokenizer). Shows the path a real 8B takes — folded frequencies, DeepSeek-YaRN,
the 1,984-dim latent compressed into vLLM's 512 (510 used) with Fisher weights — and what it costs; random
weights say nothing about quality (bench/vllm_latent.py measures that on SmolLM2).

With `--refine-steps 0,default` the same checkpoint is exported once per value, side by side:
without attention-output refinement, then with the device's default steps (`--refine-steps`),
so the refinement's cost per layer is the difference over `--layers`.

    python bench/vllm_scale.py [--layers 4] [--calib-tokens 1024] [--workdir /work] [--refine-steps 0,default]
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from memory import run_child, write_synthetic  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--workdir", default=None, help="where the synthetic checkpoint goes (needs ~4.5 GB for 4 layers)")
    p.add_argument(
        "--refine-steps",
        default="default",
        help="comma-separated --refine-steps values, one export each ('default': the option left to the device)",
    )
    p.add_argument("--out", default=str(_common.result_file("vllm_scale", "vllm_scale_llama8b.json")))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    runs = []
    try:
        src = work / "llama3-8b-shape"
        write_synthetic(src, args.layers)
        source_gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        for steps in args.refine_steps.split(","):
            runs.append(export_run(src, work / f"out-{steps}", args.calib_tokens, steps))
            print(json.dumps(runs[-1], indent=2), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": _common.command_line(),
        "machine": _common.machine(),
        "model": f"Llama-3-8B shape, {args.layers} layers, bfloat16, random weights",
        "calib_tokens": args.calib_tokens,
        "source_gb": source_gb,
        "runs": runs,
    }
    _common.write_json(Path(args.out), result)
    return 0 if all(run["exit"] == 0 for run in runs) else 1


def export_run(src: Path, out: Path, calib_tokens: int, refine_steps: str) -> dict:
    """One `convert gqa2mla --target vllm` process on `src` (its own child: peak memory is its own),
    with `--refine-steps refine_steps` unless that is 'default'; its output removed after."""
    command = ["gqa2mla", str(src), "-o", str(out), "--target", "vllm", "--calib"]
    command += [str(_common.austen_file("prideprejudice")), "--calib-tokens", str(calib_tokens), "--no-verify", "-q"]
    if refine_steps != "default":
        command += ["--refine-steps", refine_steps]
    child = run_child(command)
    written = json.loads((out / "config.json").read_text()) if child["exit"] == 0 else {}
    exported = written.get("convert_export", {})
    output_gb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9 if out.exists() else None
    shutil.rmtree(out, ignore_errors=True)
    keep = (
        "latent_content_dims",
        "latent_dims_used",
        "latent_compressed",
        "latent_weighting",
        "frequency_fold",
        "latent_refine_steps",
        "latent_calibration",
    )
    return {
        "refine_steps_option": refine_steps,
        "exit": child["exit"],
        "wall_s": child["wall_s"],
        "peak_rss_gib": child["vmhwm"] / 2**30,
        "peak_anon_gib": child["peak_anon"] / 2**30,
        "output_gb": output_gb,
        "export": {k: exported.get(k) for k in keep},
        "rope_parameters_written": written.get("rope_parameters"),
        "stderr": child.get("stderr"),
    }


if __name__ == "__main__":
    sys.exit(main())
