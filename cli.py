#!/usr/bin/env python3
"""The `convert` command (and `convert-mla`, `python cli.py` from a checkout).

A module outside the package on purpose: it imports `convert` light (no torch, no
transformers until a command needs a tensor), which only something that runs before
`convert/__init__.py` can ask for. See convert/__init__.py; `python -m convert` is the
same command after a full import.
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
