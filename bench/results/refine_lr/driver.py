"""bench/compression.py with the refinement's learning rate set (relative to each tensor's RMS;
the package's default is `convert.compress.refine.Refinement.lr`):

    python bench/results/refine_lr/driver.py LR [bench/compression.py's options...]
"""

import dataclasses
import runpy
import sys
from pathlib import Path

from convert.compress import refine

lr = float(sys.argv[1])
sized = refine.Refinement.sized.__func__


def with_rate(cls, steps, queries=None):
    """The package's sizing, then the learning rate LR."""
    return dataclasses.replace(sized(cls, steps, queries), lr=lr)


refine.Refinement.sized = classmethod(with_rate)
bench = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(bench))  # its `_common`, as for a script run from bench/
sys.argv = [str(bench / "compression.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
