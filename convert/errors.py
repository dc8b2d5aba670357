"""Errors the tool raises on purpose, each with the exit code the CLI uses (README, "Exit codes").

Every message is one line that names the file, tensor or field at fault and says how to fix it; it names options as
flags under `cli_words()` (the command line), as Python keywords otherwise (`convert.options.python_terms`).
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

    @classmethod
    def unreadable(cls, path, exc: OSError, what: str = "") -> "ConvertError":
        """An input file the system will not let us read: its path, what it is, the system's reason."""
        what = f" {what}" if what else ""
        return cls(f"{path}: cannot read{what} ({exc.strerror}); check the path and permissions")


class UnknownOption(ConvertError, TypeError):
    """A keyword the function does not take (a TypeError too, as Python's own for a bad keyword)."""


class EnvironmentFailure(ConvertError):
    """The machine, not the input, stopped the run (exit code 3): disk full, permission
    denied, read-only file system, a name too long, the output locked by another run."""

    exit_code = 3
