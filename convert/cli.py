"""The `convert` command line: a thin click shim over `convert.api` and `convert.verify`, its flags
built from the options fields (`convert.options`, `convert.cli_support`), so the CLI and the API take
the same options. Exit codes: README, "Exit codes". Light at import: a command imports the API
(`_load_api`) only once its options are valid (docs/design.md, "Layout of the code")."""

import json
import logging
import os
import sys
from pathlib import Path

import click

from convert._version import __version__
from convert.arch.registry import find_arch
from convert.arch.validate import check_config
from convert.cli_support import (
    COMMAND_EXIT_CODES,
    EXIT_CODES,
    GroupedOption,
    NoteHandler,
    SectionedCommand,
    exits_cleanly,
    options_of,
    path_option,
)
from convert.errors import ConvertError
from convert.io.locate import CONFIG_NAME, check_prelude, locate, read_config
from convert.io.output import check_output, default_output
from convert.lm_tasks import check_tasks
from convert.options import (
    ConvertOptions,
    EvalOptions,
    HealOptions,
    VerifyOptions,
)
from convert.progress import opening
from convert.targets import check_options


def _load_api() -> None:
    """What `import convert` does outside the CLI, once a command has valid options: import the
    API (torch, transformers) and register `convert_mla` with transformers' Auto classes (the
    commands load converted checkpoints through them)."""
    import convert

    convert.register()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXIT_CODES)
@click.version_option(__version__, message="%(version)s")
def main():
    """Convert Grouped-Query-Attention checkpoints to Multi-head Latent Attention.

    \b
    convert gqa2mla MODEL        convert (exactly, by default) and verify
    convert verify ORIG CONV     re-check a converted checkpoint
    convert heal CONV --text F   distil a (compressed) conversion toward the original
    convert eval CONV            lm-evaluation-harness tasks, original and converted side by side
    (`convert-mla` is the same command, for machines where ImageMagick's
    `convert` comes first on PATH; `python cli.py` from a checkout.)
    """
    logger = logging.getLogger("convert")
    if not any(isinstance(h, NoteHandler) for h in logger.handlers):
        logger.addHandler(NoteHandler(level=logging.WARNING))


@main.command(cls=SectionedCommand, epilog=COMMAND_EXIT_CODES["gqa2mla"])
@click.argument("src", type=click.Path(path_type=Path))
@path_option("-o", "--output", group="output", help="Output directory (default: <name>-mla beside the input).")
@options_of(ConvertOptions)
@exits_cleanly
def gqa2mla(src, output, **options):
    """Convert the GQA checkpoint SRC (a .safetensors file, a sharded directory or a
    Hugging Face model directory) into an MLA checkpoint directory.

    The output is written to a temporary sibling and renamed into place only when
    complete; bad input exits 2 and leaves nothing on disk. Unless --no-verify, the
    converted attention is checked against the original and the report written
    beside the weights; a FAIL exits 1.
    """
    options["calib"] = list(options.get("calib") or ()) or None  # --calib repeated: a list; none: the default
    opts = ConvertOptions.from_kwargs(**options)
    check_options(opts)  # refused before torch is imported; the API checks again
    _check_source(src, options.get("arch"))
    check_output(output or default_output(src), [src, opts.text, *opts.calib_paths], options["force"])  # no torch
    with opening(f"convert gqa2mla {src}", options["progress"]):  # a first line within seconds, off a terminal too
        _load_api()
        from convert.api import gqa2mla as run

        result = run(src, output, **options)
    if options["progress"]:
        _summary(result)
    if result.passed is False:
        _failures(result.report, result.output / "verification.md")
    sys.exit(0 if result.passed in (None, True) else 1)


def _check_source(src: Path, arch: str | None) -> None:
    """The checks of SRC that need no torch, so that a wrong path, a file that is no checkpoint, an
    unsupported family or a checkpoint already converted is refused at once (`open_checkpoint` and
    the plan make them again, with the rest)."""
    root, files, _ = locate(src)
    for file in files:
        check_prelude(file)
    config = read_config(root / CONFIG_NAME) or {}
    check_config(config)  # a model_type of the wrong type, say, before find_arch looks it up
    find_arch(config.get("model_type"), arch, config)


def _failures(report: dict, where: Path | None) -> None:
    """A FAIL where the user looks, with -q too: one stderr line per failed check (the check, the
    figure, the bound), then where the whole report is."""
    for failure in report["failures"]:
        click.echo(f"FAIL: {failure}", err=True)
    if where is not None:
        click.echo(f"report: {where}", err=True)


def _shown(path: Path) -> Path:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return Path(path)


def _summary(result) -> None:
    sizes = result.sizes
    click.echo(f"wrote {_shown(result.output)}")
    click.echo(
        f"KV cache per token: {sizes['kv_cache_bytes_per_token_before']} B (GQA) -> "
        f"{sizes['kv_cache_bytes_per_token_after']} B (MLA); attention params "
        f"{sizes['attention_params_before']:,} -> {sizes['attention_params_after']:,}"
    )
    for note in result.notes:
        click.echo(f"note: {note}")
    if result.report is not None:
        click.echo(f"verification: {result.report['verdict']} ({_shown(result.output / 'verification.md')})")


@main.command(cls=SectionedCommand, epilog=COMMAND_EXIT_CODES["verify"])
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("converted", type=click.Path(path_type=Path))
@path_option("--report-dir", group="output", help="Write verification.json/.md here (default: print only).")
@click.option(
    "-v", "--verbose", is_flag=True, cls=GroupedOption, group="output", help="Print the whole report, not its summary."
)
@options_of(VerifyOptions)
@exits_cleanly
def verify(original, converted, report_dir, verbose, **options):
    """Check CONVERTED (an MLA directory) against ORIGINAL (the GQA checkpoint):
    per layer and, for runnable architectures, end to end."""
    VerifyOptions.from_kwargs(**options)  # refused before torch is imported
    with opening(f"convert verify {converted}", options["progress"]):
        _load_api()
        from convert.verify import render_markdown, verify_paths, write_report
        from convert.verify.report import summary_lines

        report = verify_paths(original, converted, **options)
    where = None if report_dir is None else Path(report_dir) / "verification.md"
    if report_dir is not None:
        write_report(report, report_dir)
    if not options["progress"]:
        click.echo(report["verdict"])
    elif verbose:
        click.echo(render_markdown(report))
    else:
        for line in summary_lines(report):
            click.echo(line)
        click.echo(f"report: {_shown(where)}" if where else "the whole report: add -v, or --report-dir DIR to keep it")
    if report["verdict"] != "PASS":
        _failures(report, where)
    sys.exit(0 if report["verdict"] == "PASS" else 1)


@main.command(cls=SectionedCommand, epilog=COMMAND_EXIT_CODES["heal"])
@click.argument("converted", type=click.Path(path_type=Path))
@path_option(
    "--text",
    "texts",
    group="training",
    multiple=True,
    required=True,
    help="Text to heal on: UTF-8 .txt/.md, .jsonl/.json or .parquet (see --text-field); repeat for several "
    "files. Use a different text than --eval-text.",
)
@path_option(
    "--eval-text",
    group="training",
    help="Held-out text for the before/after perplexity (default: the last eighth of --text).",
)
@path_option(
    "--original",
    group="output",
    help="The GQA checkpoint CONVERTED was made from (default: the one its verification.json names).",
)
@path_option("-o", "--output", group="output", help="Output directory (default: <CONVERTED>-healed).")
@path_option(
    "--training-dir",
    group="output",
    help="Checkpoints (--save-every, --resume) and tracker logs (default: <OUTPUT>-training).",
)
@options_of(HealOptions)
@exits_cleanly
def heal(converted, texts, eval_text, original, output, training_dir, **options):
    """Heal CONVERTED (a directory written by `convert gqa2mla`): distil its MLA projections
    toward the original model's logits (KL on --text), everything else frozen.

    The healed checkpoint is written to a new directory, atomically, with its report
    (healing.json/.md: perplexity and KL before and after, on held-out tokens). A --target
    transformers/vllm export is healed as transformers' DeepseekV3 runs it (a vllm one with
    vLLM's latent-norm eps) and written under the same names: serve the healed directory as
    you would the export.

    On many processes: `accelerate launch --num_processes N -m convert heal ...` (or torchrun);
    each step trains on --batch-size x --grad-accum x N windows, the same windows in the same
    order on any number of processes. FSDP: docs/healing.md.
    """
    HealOptions.from_kwargs(**options)  # refused before torch is imported
    first = int(os.environ.get("RANK", "0")) == 0  # the process that speaks (one of many under accelerate)
    with opening(f"convert heal {converted}", options["progress"] and first):
        _load_api()
        from convert.healing import heal as run
        from convert.healing import healing_warnings

        result = run(
            converted,
            list(texts),
            original=original,
            eval_texts=eval_text,
            output=output,
            training_dir=training_dir,
            **options,
        )
    if options["progress"] and first:
        before, after = result.report["before"], result.report["after"]
        click.echo(f"wrote {_shown(result.output)}")
        click.echo(
            f"perplexity ratio to the original: {before['ppl_ratio']:.4f} -> {after['ppl_ratio']:.4f}, "
            f"KL {before['kl_mean']:.4g} -> {after['kl_mean']:.4g} "
            f"({result.report['eval_tokens']} held-out tokens; {_shown(result.output / 'healing.md')})"
        )
        checks = result.report["checks"]
        if checks:
            click.echo(
                f"kept the weights of step {checks['best_step']} of {result.report['steps']}, the best on "
                f"{checks['tokens']} check tokens of --text (rate halved {checks['halvings']} times)"
            )
    for warning in healing_warnings(result.report) if first else ():
        click.echo(f"warning: {warning}", err=True)


@main.command("eval", cls=SectionedCommand, epilog=COMMAND_EXIT_CODES["eval"])
@click.argument("dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@path_option(
    "--original",
    group="output",
    help="The GQA checkpoint DIRS were converted from, evaluated first (default: the one their verification.json names).",
)
@path_option("-o", "--output", group="output", help="Also write the results as JSON to this file.")
@options_of(EvalOptions)
@exits_cleanly
def evaluate(dirs, original, output, **options):
    """Run lm-evaluation-harness tasks on DIRS (directories written by `convert gqa2mla`: the native
    format or an export, each run as its runtime computes it) and on the original checkpoint, one
    model at a time, and print the figures side by side: the original first, then each directory,
    with its ratio to the original on the perplexities.

    \b
    convert_ppl  perplexity over a held-out text (the opening of Austen's Emma)
    convert_mc   32 multiple-choice cloze sentences from the same chapter (acc, acc_norm)
    """
    opts = EvalOptions.from_kwargs(**options)  # refused before torch is imported
    for path in (*dirs, *([original] if original is not None else [])):
        if not (path / "config.json").is_file():  # the words of convert.evaluate's check, which needs torch
            raise ConvertError(
                f"{path}: no such model directory (no config.json); pass a directory with its config.json"
            )
    if output is not None and (output.is_dir() or not output.resolve().parent.is_dir()):
        raise ConvertError(f"--output {output}: not a file in an existing directory; pass e.g. --output results.json")
    check_tasks(opts.task_names)  # an unknown task or a missing lm_eval: one line, before the first progress line
    with opening(f"convert eval {' '.join(map(str, dirs))}", True):  # lm_eval's own bars are not every 30 s
        _load_api()
        from convert.evaluate import evaluate as run
        from convert.evaluate import render_markdown

        results = run(list(dirs), options.pop("tasks"), original=original, **options)
    click.echo(render_markdown(results))
    if output is not None:
        output.write_text(json.dumps(results, indent=2) + "\n")
        click.echo(f"wrote {output}")


if __name__ == "__main__":
    main()
