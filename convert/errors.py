"""Errors the tool raises on purpose, each with the exit code the CLI uses.

Every message is one line that names the file, tensor or field at fault and
says how to fix it.
"""


class ConvertError(Exception):
    """Bad input or a refused request (exit code 2). Nothing is left on disk."""

    exit_code = 2


class VerificationFailed(Exception):
    """The converted model does not compute what the original computed (exit code 1)."""

    exit_code = 1
