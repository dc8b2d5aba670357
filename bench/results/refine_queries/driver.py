"""bench/results/refine_reuse/driver.py (phase times of a SmolLM2 factored conversion at a share, and
its one-shot perplexity ratio on Northanger Abbey) with the refinement's steps and query positions set:

    python bench/results/refine_queries/driver.py 0.25 STEPS QUERIES   # QUERIES: a count, or all
"""

import dataclasses
import runpy
import sys
from pathlib import Path

from convert.compress import refine

steps, queries = int(sys.argv[2]), None if sys.argv[3] == "all" else int(sys.argv[3])
sized = refine.Refinement.sized.__func__


def resized(cls, given_steps, given_queries=None):
    """The package's sizing, then STEPS of QUERIES positions wherever it refines."""
    how = sized(cls, given_steps, given_queries)
    return dataclasses.replace(how, steps=steps, queries=queries) if how.steps else how


refine.Refinement.sized = classmethod(resized)
sys.argv = [sys.argv[0], sys.argv[1], "--ppl"]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "refine_reuse" / "driver.py"), run_name="__main__")
