"""glibc's allocator, set for tensors: large blocks are mapped and unmapped on their own.

glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to
32 MB) each time a mapped block is freed. On CPU a learner step and a generation batch allocate and
free thousands of tensors of 1-32 MB; once the threshold has risen they all come from the heap, which
fragments and is never given back. Measured on the SmolLM2 arithmetic run: peak RSS of `loopline train`
7.2 GB with glibc's defaults, 4.9 GB with a fixed 1 MB threshold; the learner alone 6.2 -> 4.5 GB at
the same seconds per step (2 rounds, side by side). A fixed threshold also stops the raising.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune() -> bool:
    """Set this process's threshold, and its children's (through glibc's environment variable); False
    where the C library is not glibc or a user set the variable already (theirs is kept)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    return True


def give_back() -> bool:
    """Return the free pages inside the heap to the system (glibc's `malloc_trim`); False where the C library is
    not glibc. Tensors below the threshold (a cached prefix's keys and values: a layer's few hundred KB) come from
    the heap, and `free` gives back only its top: measured on the race's sync step, the engine's dropped prefix
    cache left 1.9 GiB of free heap resident under the learner that ran next (docs/benchmarks.md)."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim is not None and trim(0) >= 0)
