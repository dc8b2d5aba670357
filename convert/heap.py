"""Giving freed memory back to the operating system between the phases of a run."""

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; a no-op elsewhere).

    Layers built and dropped one after another, on several threads, leave their freed pages in
    glibc's arenas, where they count in the process's resident memory until reused, so the next
    phase's peak would sit on top of them (bench/memory.py measures the peaks). Objects in reference
    cycles are collected first: a model that has run `generate` is one, and would stay whole until
    Python's collector happened to run (measured: SmolLM2's original, 0.5 GiB, still resident while
    the converted model generated).
    """
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
