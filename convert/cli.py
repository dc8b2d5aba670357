"""The `convert` command line: a thin click shim over `convert.api` and `convert.verify`.

Every flag is built from a field of `ConvertOptions` / `VerifyOptions`
(`convert.options`): declared once, so the CLI and the API take the same
options. Exit codes (README, "Exit codes"): 0 PASS, 1 verification FAIL, 2 bad
input or usage, 3 environment or I/O, 130 interrupted — each with one line on
stderr.
"""

import errno
import logging
import sys
from functools import wraps
from pathlib import Path

import click

from convert.errors import ConvertError
from convert.options import ConvertOptions, HealOptions, VerifyOptions, cli_fields, field_default

EXIT_CODES = """\b
Exit codes:
  0    PASS (or converted with --no-verify)
  1    verification FAIL (the output and its report are kept)
  2    bad input or usage: one line naming the file/field and the fix; nothing written
  3    environment or I/O: disk full, permission, read-only, name too long, output locked
  130  interrupted (Ctrl-C); a previous output is left intact
"""


def _click_option(f):
    """The click option of one options field."""
    meta, name = f.metadata, f.name
    default = field_default(f)
    if meta["off_flag"]:  # a boolean that the flag switches off
        decls = [d for d in (meta["short"], meta["off_flag"]) if d]
        return click.option(*decls, name, is_flag=True, flag_value=not default, default=default, help=meta["help"])
    decls = [d for d in (meta["short"], meta["flag"] or "--" + name.replace("_", "-")) if d]
    if isinstance(default, bool):
        return click.option(*decls, name, is_flag=True, default=default, help=meta["help"])
    kind = click.Choice(meta["choices"]) if meta["choices"] else (meta["kind"] or type(default))
    if kind is Path:
        kind = click.Path(path_type=Path)
    return click.option(*decls, name, type=kind, default=default, show_default=default is not None, help=meta["help"])


def options_of(cls):
    """Decorate a click command with one option per CLI field of `cls`."""

    def decorate(fn):
        for f in reversed(cli_fields(cls)):
            fn = _click_option(f)(fn)
        return fn

    return decorate


def _exits_cleanly(fn):
    """Every failure as one line on stderr and its exit code (the table in EXIT_CODES)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConvertError as err:
            _fail(str(err), err.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written (a previous output is intact)", 130)
        except OSError as err:
            _fail(_os_error_line(err), 3)

    return wrapper


def _fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _os_error_line(err: OSError) -> str:
    fixes = {
        errno.ENOSPC: "free some space or write elsewhere (-o)",
        errno.EACCES: "check the permissions, or write elsewhere (-o)",
        errno.EROFS: "the file system is read-only: write elsewhere (-o)",
        errno.ENAMETOOLONG: "choose a shorter output name",
    }
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err}{where}; {fixes.get(err.errno, 'check the disk and the paths, then retry')}"


class _NoteHandler(logging.Handler):
    """The package's warnings (e.g. stale temporaries removed) as `note:` lines on stderr."""

    def emit(self, record):
        click.echo(f"note: {record.getMessage()}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(package_name="convert", message="%(version)s")
def main():
    """Convert Grouped-Query-Attention checkpoints to Multi-head Latent Attention.

    \b
    convert gqa2mla MODEL        convert (exactly, by default) and verify
    convert verify ORIG CONV     re-check a converted checkpoint
    convert heal CONV --text F   distil a (compressed) conversion toward the original
    (`convert-mla` is the same command, for machines where ImageMagick's
    `convert` comes first on PATH; `python cli.py` from a checkout.)
    """
    logger = logging.getLogger("convert")
    if not any(isinstance(h, _NoteHandler) for h in logger.handlers):
        logger.addHandler(_NoteHandler(level=logging.WARNING))


@main.command(epilog=EXIT_CODES)
@click.argument("src", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="Output directory (default: <name>-mla beside the input)."
)
@options_of(ConvertOptions)
@_exits_cleanly
def gqa2mla(src, output, **options):
    """Convert the GQA checkpoint SRC (a .safetensors file, a sharded directory or a
    Hugging Face model directory) into an MLA checkpoint directory.

    The output is written to a temporary sibling and renamed into place only when
    complete; bad input exits 2 and leaves nothing on disk. Unless --no-verify, the
    converted attention is checked against the original and the report written
    beside the weights; a FAIL exits 1.
    """
    from convert.api import gqa2mla as run

    result = run(src, output, **options)
    if options["progress"]:
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


@main.command(epilog=EXIT_CODES)
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("converted", type=click.Path(path_type=Path))
@click.option(
    "--report-dir", type=click.Path(path_type=Path), help="Write verification.json/.md here (default: print only)."
)
@options_of(VerifyOptions)
@_exits_cleanly
def verify(original, converted, report_dir, **options):
    """Check CONVERTED (an MLA directory) against ORIGINAL (the GQA checkpoint):
    per layer and, for runnable architectures, end to end."""
    from convert.verify import render_markdown, verify_paths, write_report

    report = verify_paths(original, converted, **options)
    if report_dir is not None:
        write_report(report, report_dir)
    click.echo(render_markdown(report) if options["progress"] else report["verdict"])
    sys.exit(0 if report["verdict"] == "PASS" else 1)


@main.command(epilog=EXIT_CODES)
@click.argument("converted", type=click.Path(path_type=Path))
@click.option(
    "--text",
    "texts",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path),
    help="Text to heal on (UTF-8; repeat for several files). Use a different text than --eval-text.",
)
@click.option(
    "--eval-text",
    type=click.Path(path_type=Path),
    help="Held-out text for the before/after perplexity (default: the last eighth of --text).",
)
@click.option(
    "--original",
    type=click.Path(path_type=Path),
    help="The GQA checkpoint CONVERTED was made from (default: the one its verification.json names).",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output directory (default: <CONVERTED>-healed).")
@options_of(HealOptions)
@_exits_cleanly
def heal(converted, texts, eval_text, original, output, **options):
    """Heal CONVERTED (a directory written by `convert gqa2mla`): distil its MLA projections
    toward the original model's logits (KL on --text), everything else frozen.

    The healed checkpoint is written to a new directory, atomically, with its report
    (healing.json/.md: perplexity and KL before and after, on held-out tokens). A --target
    transformers/vllm export is healed as transformers' DeepseekV3 runs it (a vllm one with
    vLLM's latent-norm eps) and written under the same names: serve the healed directory as
    you would the export.
    """
    from convert.healing import heal as run
    from convert.healing import healing_warnings

    result = run(converted, list(texts), original=original, eval_texts=eval_text, output=output, **options)
    if options["progress"]:
        before, after = result.report["before"], result.report["after"]
        click.echo(f"wrote {result.output}")
        click.echo(
            f"perplexity ratio to the original: {before['ppl_ratio']:.4f} -> {after['ppl_ratio']:.4f}, "
            f"KL {before['kl_mean']:.4g} -> {after['kl_mean']:.4g} "
            f"({result.report['eval_tokens']} held-out tokens; {result.output / 'healing.md'})"
        )
        checks = result.report["checks"]
        if checks:
            click.echo(
                f"kept the weights of step {checks['best_step']} of {result.report['steps']}, the best on "
                f"{checks['tokens']} check tokens of --text (rate halved {checks['halvings']} times)"
            )
    for warning in healing_warnings(result.report):
        click.echo(f"warning: {warning}", err=True)


if __name__ == "__main__":
    main()
