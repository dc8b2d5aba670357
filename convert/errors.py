"""Errors the tool raises on purpose, each with the exit code the CLI uses.

Every message is one line that names the file, tensor or field at fault and
says how to fix it. The CLI maps them (README, "Exit codes"): 0 PASS, 1
verification FAIL (not an exception: `ConversionResult.passed`), 2
`ConvertError`, 3 `EnvironmentFailure`, 130 interrupted (KeyboardInterrupt).

A message names options as the command line spells them (`--kv-cache-ratio 0.5`, `-o`); raised
to a Python caller it names them as keywords instead (`kv_cache_ratio=0.5`, `output`): the
command line says so with `cli_words()` around a command (`convert.options.python_terms`, set by `speak_python`).
"""

from contextlib import contextmanager

_cli_words = False  # True while the command line runs a command (`cli_words`)
_python_terms = str  # a message in the Python API's words: convert.options sets it (`speak_python`)


def speak_python(translate) -> None:
    """Set how a message's flags become Python keywords (convert.options, which knows the flags,
    calls it on import: this bottom layer may not import it)."""
    global _python_terms
    _python_terms = translate


@contextmanager
def cli_words():
    """Messages raised inside keep the command line's words (flags) instead of Python keywords."""
    global _cli_words
    before, _cli_words = _cli_words, True
    try:
        yield
    finally:
        _cli_words = before


class ConvertError(Exception):
    """Bad input or a refused request (exit code 2). Nothing is left on disk."""

    exit_code = 2

    def __init__(self, message: str = "", *args):
        if isinstance(message, str) and not _cli_words:
            message = _python_terms(message)
        super().__init__(message, *args)


class UnknownOption(ConvertError, TypeError):
    """A keyword the function does not take (a TypeError too, as Python's own for a bad keyword)."""


class EnvironmentFailure(ConvertError):
    """The machine, not the input, stopped the run (exit code 3): disk full, permission
    denied, read-only file system, a name too long, the output locked by another run."""

    exit_code = 3
