"""The `convert` command line: a thin click shim over `convert.api`.

Every flag maps to one field of `ConvertOptions`. Bad input prints one line
and exits 2; a verification FAIL exits 1; success exits 0.
"""

import sys
from functools import wraps
from pathlib import Path

import click

from convert.errors import ConvertError

DEVICE_HELP = "Where verification runs: auto = CUDA when present, else CPU."


def _exits_cleanly(fn):
    """Turn ConvertError into one line on stderr and exit code 2."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConvertError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(ConvertError.exit_code)

    return wrapper


def verify_options(fn):
    """The flags shared by `gqa2mla` (its verification step) and `verify`."""
    for decorator in reversed(
        [
            click.option(
                "--text",
                type=click.Path(path_type=Path),
                help="Real text to verify on (UTF-8); default: random tokens and hidden states.",
            ),
            click.option(
                "--tokens", type=int, default=256, show_default=True, help="Tokens of --text (or random) to verify on."
            ),
            click.option(
                "--device",
                type=click.Choice(["auto", "cpu", "cuda"]),
                default="auto",
                show_default=True,
                help=DEVICE_HELP,
            ),
            click.option(
                "--dtype",
                type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
                default="float64",
                show_default=True,
                help="Precision of the verification run; thresholds follow it.",
            ),
        ]
    ):
        fn = decorator(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="convert", message="%(version)s")
def main():
    """Convert Grouped-Query-Attention checkpoints to Multi-head Latent Attention.

    \b
    convert gqa2mla MODEL        convert (exactly, by default) and verify
    convert verify ORIG CONV     re-check a converted checkpoint
    """


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="Output directory (default: <name>-mla beside the input)."
)
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
@click.option("--arch", help="Architecture when there is no config.json: llama, mistral, qwen2, seed.")
@click.option("--n-heads", type=int, help="Query heads H (only when config.json lacks them).")
@click.option("--n-kv-heads", type=int, help="Key/value heads G (only when config.json lacks them).")
@click.option("--head-dim", type=int, help="Head dim d (default: inferred from the shapes).")
@click.option(
    "--head-map",
    type=click.Choice(["grouped", "tiled"]),
    help="Which K/V head each query head reads: grouped = h // (H/G) (Hugging Face), tiled = h mod G (the seed). Default: the architecture's.",
)
@click.option(
    "--latent",
    type=click.Choice(["split", "joint"]),
    default="split",
    show_default=True,
    help="split: separate K and V latents; joint: one shared latent (keys without RoPE only).",
)
@click.option(
    "--layout",
    type=click.Choice(["absorbed", "factored"]),
    default="absorbed",
    show_default=True,
    help="absorbed: Ŵ^Q/Ŵ^O over the latent (MQA, head dim r); factored: keep W^Q, W^UK, W^UV, W^O.",
)
@click.option(
    "--rank",
    type=int,
    help="Latent dims per latent (default: the exact rank; lower compresses the KV cache, lossy; or use --kv-cache-ratio).",
)
@click.option(
    "--kv-cache-ratio", type=float, help="Compress: keep this fraction of the GQA KV cache (e.g. 0.5); lossy."
)
@click.option(
    "--method",
    type=click.Choice(["svd", "whitened", "fisher"]),
    help="Compression: plain weight SVD; activation-whitened SVD; whitened + weighted by the loss's Fisher information of each key/value output (fisher: one backward pass of the whole model on --calib). Default: fisher with --calib, else svd.",
)
@click.option(
    "--allocation",
    type=click.Choice(["uniform", "global"]),
    help="Compression: same rank in every latent, or spend the budget across layers and K/V by weighted energy. Default: global for fisher.",
)
@click.option(
    "--calib",
    type=click.Path(path_type=Path),
    help="Compression: real text to calibrate on (UTF-8); use a different text for --text.",
)
@click.option("--calib-tokens", type=int, default=4096, show_default=True, help="Tokens of --calib to use.")
@click.option(
    "--max-ppl-ratio",
    type=float,
    help="Lossy conversions: FAIL when converted/original perplexity on --text exceeds this.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Start a new safetensors shard above this many bytes (e.g. 500MB, 5GB, 2GiB).",
)
@click.option("--no-verify", is_flag=True, help="Skip verification (no report is written).")
@verify_options
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
@_exits_cleanly
def gqa2mla(src, output, quiet, no_verify, **flags):
    """Convert the GQA checkpoint SRC (a .safetensors file, a sharded directory or a
    Hugging Face model directory) into an MLA checkpoint directory.

    The output is written to a temporary sibling and renamed into place only when
    complete; bad input exits 2 and leaves nothing on disk. Unless --no-verify, the
    converted attention is checked against the original and the report written
    beside the weights; a FAIL exits 1.
    """
    from convert.api import gqa2mla as run

    result = run(src, output, progress=not quiet, verify=not no_verify, **flags)
    if not quiet:
        _summary(result)
    sys.exit(0 if result.passed in (None, True) else 1)


def _summary(result) -> None:
    sizes = result.sizes
    click.echo(f"wrote {result.output}")
    click.echo(
        f"KV cache per token: {sizes['kv_cache_bytes_per_token_before']} B (GQA) -> "
        f"{sizes['kv_cache_bytes_per_token_after']} B (MLA); attention params "
        f"{sizes['attention_params_before']:,} -> {sizes['attention_params_after']:,}"
    )
    for note in result.notes:
        click.echo(f"note: {note}")
    if result.report is not None:
        click.echo(f"verification: {result.report['verdict']} ({result.output / 'verification.md'})")


@main.command()
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("converted", type=click.Path(path_type=Path))
@verify_options
@click.option(
    "--max-ppl-ratio", type=float, help="Fail when converted/original perplexity exceeds this (lossy conversions)."
)
@click.option(
    "--report-dir", type=click.Path(path_type=Path), help="Write verification.json/.md here (default: print only)."
)
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict.")
@_exits_cleanly
def verify(original, converted, report_dir, quiet, **flags):
    """Check CONVERTED (an MLA directory) against ORIGINAL (the GQA checkpoint):
    per layer and, for runnable architectures, end to end. Exit 0 PASS, 1 FAIL, 2 bad input."""
    from convert.verify import render_markdown, verify_paths, write_report

    report = verify_paths(original, converted, **flags)
    if report_dir is not None:
        write_report(report, report_dir)
    click.echo(report["verdict"] if quiet else render_markdown(report))
    sys.exit(0 if report["verdict"] == "PASS" else 1)


if __name__ == "__main__":
    main()
