"""The heap of a process that runs graphs: freed activation buffers kept for the next call.

glibc's malloc serves each block over its mmap threshold (32 MiB at most, however it adapts) with a fresh mmap
and unmaps it on free, so every call of a large graph faults its big activations in and zeroes them again: the
fp32 real-width step at 1024x1024 takes ~420k page faults and 0.8-1.0 s of kernel time a step (bf16: 0.4 s, its
buffers are half the size; docs/benchmarks.md, "The heap"). glibc's own switches keep them, as a preloaded
tcmalloc or jemalloc would, without a library:
- no mmap for large blocks (M_MMAP_MAX 0) and no trim of the heap's free top (M_TRIM_THRESHOLD at its largest), so
  a freed buffer is reused, already faulted in, by the next step;
- one arena (M_ARENA_MAX 1): a thread other than the main one (`qic serve` computes on its runner thread) would
  otherwise get an arena of 64 MiB heaps, which serves any larger block with mmap whatever M_MMAP_MAX says and
  unmaps a heap once it empties whatever M_TRIM_THRESHOLD says. qic computes on one thread at a time (torch's
  OpenMP threads allocate little), so the one arena's lock is not contended.
The cost: the process keeps its high-water heap, which a process that draws image after image reaches at every
step anyway. Weights are memory-mapped files, not heap, and are unmapped when dropped as before.

`qic run` and `qic serve` call keep_freed_blocks() before they load or fork anything (forked ranks inherit the
setting; the MALLOC_ variables carry it to processes started afresh, glibc reading them at start);
QIC_KEEP_FREED_BLOCKS=0 leaves malloc as it is, and a MALLOC_ variable the user set is left to them. Not glibc
(musl, macOS): nothing to do, and nothing is done.
"""

from __future__ import annotations

import ctypes
import os

_INT_MAX = 2**31 - 1   # mallopt takes an int: 2 GiB of free heap top is kept (the variable's form takes more)
# (glibc's mallopt parameter, its value, the variable that sets it at a process's start, that variable's value):
# M_TRIM_THRESHOLD first, so that a failure never leaves mmap off with trimming still on.
_SETTINGS = ((-1, _INT_MAX, "MALLOC_TRIM_THRESHOLD_", str(2**62)),
             (-4, 0, "MALLOC_MMAP_MAX_", "0"),
             (-8, 1, "MALLOC_ARENA_MAX", "1"))


def is_glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):   # an unknown name (not glibc), or no confstr (Windows)
        return False


def keep_freed_blocks() -> bool:
    """Keep freed heap blocks in this process and the processes it starts; True where that took effect."""
    if os.environ.get("QIC_KEEP_FREED_BLOCKS", "1") == "0" or not is_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt   # the process's own C library
    for param, value, variable, inherited in _SETTINGS:
        if variable in os.environ:        # set by the user: glibc read it at this process's start
            continue
        if mallopt(param, value) != 1:
            return False
        os.environ[variable] = inherited
    return True
