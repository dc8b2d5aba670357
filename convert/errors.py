"""Errors the tool raises on purpose, each with the exit code the CLI uses.

Every message is one line that names the file, tensor or field at fault and
says how to fix it. The CLI maps them (README, "Exit codes"): 0 PASS, 1
verification FAIL (not an exception: `ConversionResult.passed`), 2
`ConvertError`, 3 `EnvironmentFailure`, 130 interrupted (KeyboardInterrupt).
"""


class ConvertError(Exception):
    """Bad input or a refused request (exit code 2). Nothing is left on disk."""

    exit_code = 2


class EnvironmentFailure(ConvertError):
    """The machine, not the input, stopped the run (exit code 3): disk full, permission
    denied, read-only file system, a name too long, the output locked by another run."""

    exit_code = 3
