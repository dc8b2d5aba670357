"""The command line's building blocks: exit-code tables, click options built from the options
fields (`convert.options`), `--help` in sections, typo suggestions, and every failure as one
stderr line with its exit code. `convert.cli` declares the commands with them."""

import errno
import logging
import os
import sys
import tempfile
import traceback
from functools import wraps
from pathlib import Path

import click

from convert.errors import ConvertError, cli_words
from convert.options import GROUPS, cli_fields, field_default, long_flag, suggest

_USAGE = ("2", "bad input or usage: one line naming the file/field and the fix; nothing written")
_INTERRUPTED = ("130", "interrupted (Ctrl-C); a previous output is left intact")
_IO = ("3", "environment or I/O: disk full, permission, read-only, name too long, output locked")
_INTERNAL = ("4", "internal error (a bug in convert): one line, the traceback saved to a file; nothing written")


def _exit_table(*rows: tuple[str, str]) -> str:
    return "\b\nExit codes:\n" + "".join(f"  {code:<4} {meaning}\n" for code, meaning in rows)


#: The whole command's table (README, "Exit codes"); each command's --help shows its own (`COMMAND_EXIT_CODES`).
EXIT_CODES = _exit_table(
    ("0", "PASS (or done: converted with --no-verify, healed)"),
    ("1", "verification FAIL"),
    _USAGE,
    _IO,
    _INTERNAL,
    _INTERRUPTED,
)
COMMAND_EXIT_CODES = {
    "gqa2mla": _exit_table(
        ("0", "PASS (or converted with --no-verify)"),
        ("1", "verification FAIL (the output and its report are kept)"),
        _USAGE,
        _IO,
        _INTERNAL,
        _INTERRUPTED,
    ),
    "verify": _exit_table(
        ("0", "PASS"),
        ("1", "FAIL: one stderr line per failed check (and the report, with --report-dir)"),
        ("2", "bad input or usage: one line naming the file/field and the fix"),
        ("3", "environment or I/O: unreadable input, or --report-dir not writable"),
        _INTERNAL,
        ("130", "interrupted (Ctrl-C)"),
    ),
    "heal": _exit_table(
        ("0", "healed: the new directory and its report are written"), _USAGE, _IO, _INTERNAL, _INTERRUPTED
    ),
    "eval": _exit_table(
        ("0", "done: the side-by-side table printed (and --output written)"),
        ("2", "bad input or usage: one line naming the directory, task or option and the fix"),
        ("3", "environment or I/O: lm_eval not installed (pip install 'convert[eval]'), --output not writable"),
        _INTERNAL,
        ("130", "interrupted (Ctrl-C)"),
    ),
}


class GroupedOption(click.Option):
    """A click option that knows its `--help` section (a key of `convert.options.GROUPS`)."""

    def __init__(self, *args, group: str = "advanced", **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


class SectionedCommand(click.Command):
    """A command whose `--help` lists its options by section, in the order of GROUPS, and whose
    answer to a misspelled flag names only the flags it is likely a typo of (`convert.options.suggest`)."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as err:
            flags = [d for p in self.get_params(ctx) for d in (*p.opts, *p.secondary_opts) if d.startswith("--")]
            likely = suggest(err.option_name, flags)
            fix = f" Did you mean {' or '.join(likely)}?" if likely else f" See 'convert {self.name} --help'."
            raise click.NoSuchOption(err.option_name, f"No such option {err.option_name!r}.{fix}", ctx=ctx) from None

    def format_options(self, ctx, formatter):
        sections: dict[str, list] = {group: [] for group in GROUPS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:  # arguments are named by the usage line
                sections[getattr(param, "group", "advanced")].append(record)
        for group, records in sections.items():
            if records:
                with formatter.section(GROUPS[group]):
                    formatter.write_dl(records)


def click_option(f):
    """The click option of one options field."""
    meta, name = f.metadata, f.name
    default = field_default(f)
    common = {"cls": GroupedOption, "group": meta["group"], "help": meta["help"]}
    if meta["off_flag"]:  # a boolean that the flag switches off
        decls = [d for d in (meta["short"], meta["off_flag"]) if d]
        return click.option(*decls, name, is_flag=True, flag_value=not default, default=default, **common)
    decls = [d for d in (meta["short"], long_flag(f)) if d]
    if isinstance(default, bool):
        return click.option(*decls, name, is_flag=True, default=default, **common)
    kind = click.Choice(meta["choices"], case_sensitive=False) if meta["choices"] else (meta["kind"] or type(default))
    if kind is Path:
        kind = click.Path(path_type=Path)
    if meta.get("multiple"):
        return click.option(*decls, name, type=kind, multiple=True, default=default, **common)
    return click.option(*decls, name, type=kind, default=default, show_default=default is not None, **common)


def path_option(*decls, group: str, **kwargs):
    """A path option of a command that is not an options field (-o, --report-dir, heal's texts)."""
    return click.option(*decls, cls=GroupedOption, group=group, type=click.Path(path_type=Path), **kwargs)


def options_of(cls):
    """Decorate a click command with one option per CLI field of `cls`."""

    def decorate(fn):
        for f in reversed(cli_fields(cls)):
            fn = click_option(f)(fn)
        return fn

    return decorate


def exits_cleanly(fn):
    """Every failure as one line on stderr and its exit code (the table in EXIT_CODES)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with cli_words():  # messages name the flags, not the Python keywords
                return fn(*args, **kwargs)
        except ConvertError as err:
            fail(str(err), err.exit_code)
        except KeyboardInterrupt:
            fail("interrupted; nothing was written (a previous output is intact)", 130)
        except OSError as err:
            fail(os_error_line(err), 3)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own usage errors and exits keep their codes
        except Exception as err:  # a bug: it must never leave with a verification FAIL's code
            fail(internal_error_line(err), 4)

    return wrapper


def fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def internal_error_line(err: Exception) -> str:
    """One line for a bug: what was raised and where, and the file that keeps its traceback."""
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    fd, path = tempfile.mkstemp(prefix="convert-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(err)))
    return (
        f"internal error (a bug in convert, not in your input): {type(err).__name__}: {err}{where}; "
        f"the traceback is in {path}: please report it with the command you ran"
    )


def os_error_line(err: OSError) -> str:
    fixes: dict[int | None, str] = {  # by err.errno (None for an error raised without one)
        errno.ENOSPC: "free some space or write elsewhere (-o)",
        errno.EACCES: "check the permissions, or write elsewhere (-o)",
        errno.EROFS: "the file system is read-only: write elsewhere (-o)",
        errno.ENAMETOOLONG: "choose a shorter output name",
    }
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err}{where}; {fixes.get(err.errno, 'check the disk and the paths, then retry')}"


class NoteHandler(logging.Handler):
    """The package's warnings (e.g. stale temporaries removed) as `note:` lines on stderr."""

    def emit(self, record):
        click.echo(f"note: {record.getMessage()}", err=True)
