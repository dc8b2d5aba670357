"""The vllm target at Llama-3-8B's shape: wall time and peak memory of one `convert gqa2mla
--target vllm` process on a synthetic checkpoint (random bfloat16 weights, `--llama8b N`
decoder layers of the real shape: 32 query heads, 8 key/value heads of d = 128, D = 4,096,
llama3 RoPE, vocabulary 128,256), calibrated on an Austen novel (UTF-8 bytes: the synthetic
model has no tokenizer). Shows the path a real 8B takes — folded frequencies, DeepSeek-YaRN,
the 1,984-dim latent compressed into 512 with Fisher weights — and what it costs; random
weights say nothing about quality (bench/vllm_latent.py measures that on SmolLM2).

    python bench/vllm_scale.py [--layers 4] [--calib-tokens 1024] [--workdir /work]
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
    p.add_argument("--out", default=str(_common.RESULTS / "vllm_scale_llama8b.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        src, out = work / "llama3-8b-shape", work / "out"
        write_synthetic(src, args.layers)
        child = run_child(
            [
                "gqa2mla",
                str(src),
                "-o",
                str(out),
                "--target",
                "vllm",
                "--calib",
                str(_common.austen_file("prideprejudice")),
                "--calib-tokens",
                str(args.calib_tokens),
                "--no-verify",
                "-q",
            ]
        )
        written = json.loads((out / "config.json").read_text()) if child["exit"] == 0 else {}
        exported = written.get("convert_export", {})
        source_gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        output_gb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9 if out.exists() else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keep = ("latent_content_dims", "latent_dims_used", "latent_compressed", "latent_weighting", "frequency_fold")
    result = {
        "command": _common.command_line(),
        "machine": _common.machine(),
        "model": f"Llama-3-8B shape, {args.layers} layers, bfloat16, random weights",
        "calib_tokens": args.calib_tokens,
        "exit": child["exit"],
        "wall_s": child["wall_s"],
        "peak_rss_gib": child["vmhwm"] / 2**30,
        "peak_anon_gib": child["peak_anon"] / 2**30,
        "source_gb": source_gb,
        "output_gb": output_gb,
        "export": {k: exported.get(k) for k in keep},
        "rope_parameters_written": written.get("rope_parameters"),
        "stderr": child.get("stderr"),
    }
    print(json.dumps(result, indent=2))
    _common.write_json(Path(args.out), result)
    return 0 if child["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
