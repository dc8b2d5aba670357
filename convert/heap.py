"""Giving freed memory back to the operating system between the phases of a run."""

import contextlib
import ctypes
import ctypes.util
import functools
import gc

M_MMAP_THRESHOLD = -3  # malloc.h's mallopt parameter
#: While a run verifies, every allocation from this size up is mapped afresh and unmapped when freed.
MAPPED_FROM = 1 << 20
#: The threshold set back afterwards: glibc's own ceiling for the one it raises as large blocks are freed
#: (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), where a long-running process's threshold ends up anyway.
GROWN_THRESHOLD = 32 << 20


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


@contextlib.contextmanager
def large_allocations_mapped():
    """Within the block, glibc maps every allocation of `MAPPED_FROM` bytes or more on its own and gives it
    back when it is freed (mallopt M_MMAP_THRESHOLD; a no-op where there is no mallopt).

    glibc raises its threshold each time a mapped block is freed, so after the first freed layer,
    layers of that size and smaller come from the heap, where what they leave behind stays resident:
    streamed greedy generation builds and drops every decoder layer once per new token, and SmolLM2's
    run under `--max-memory 0.9GiB` peaked anywhere from 0.73 to 0.94 GiB (over its cap) with the
    threshold as glibc moves it, at 0.68-0.69 GiB with it fixed, in about the same time (docs/performance.md,
    "Memory"). Afterwards the threshold is set to `GROWN_THRESHOLD`, glibc's own ceiling."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, MAPPED_FROM):
        yield
        return
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, GROWN_THRESHOLD)
