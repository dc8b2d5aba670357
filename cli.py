#!/usr/bin/env python3
"""Entry point of the `convert` and `convert-mla` console scripts (and `python cli.py` from a checkout).

It defines no command: it imports `main` from `convert.cli` (the click group) with the package's
light-import switch set, so `convert` comes in light (no torch, no transformers until a command
needs a tensor). Only a module outside the package, run before `convert/__init__.py`, can ask for
that; see convert/__init__.py. `python -m convert` runs the same command after a full import.
"""

import os

_SWITCH = "CONVERT_LIGHT_IMPORT"  # convert.LIGHT_IMPORT, which cannot be read before convert is imported
_before = os.environ.get(_SWITCH)
os.environ[_SWITCH] = "1"
try:
    from convert.cli import main
finally:  # only this import: child processes and later imports see the environment as it was
    if _before is None:
        del os.environ[_SWITCH]
    else:
        os.environ[_SWITCH] = _before

if __name__ == "__main__":
    main()
