"""The heap of a process that runs graphs: freed activation buffers kept for the next call.

glibc's malloc serves each block over its mmap threshold (32 MiB at most, however it adapts) with a fresh mmap
and unmaps it on free, so every call of a large graph faults its big activations in and zeroes them again: the
fp32 real-width step at 1024x1024 takes ~420k page faults and 0.85 s of kernel time a step, 6% of it (bf16: 0.41
s, its buffers are half the size; docs/benchmarks.md, "The heap"). PyTorch's CPU launcher (torch.backends.xeon.run_cpu)
preloads jemalloc with its decay off for the same reason; glibc's own switches do it without a library: no mmap
for large blocks (M_MMAP_MAX 0) and no trim of the heap's free top (M_TRIM_THRESHOLD at its largest), so a freed
buffer is reused, already faulted in, by the next step. The cost: the process keeps its high-water heap, which
a process that draws images again and again reaches at every step anyway.

`qic run` and `qic serve` call keep_freed_blocks() before they load or fork anything (forked ranks inherit the
setting; the environment variables carry it to processes started afresh); QIC_KEEP_FREED_BLOCKS=0 leaves
malloc as it is. Not glibc (musl, macOS): nothing to do, and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_LARGEST = 2**31 - 1   # mallopt takes an int: 2 GiB of free heap top is kept (the environment's form takes more)
_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # mallopt alone is no proof: musl exports a mallopt that ignores everything
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_blocks() -> bool:
    """Keep freed heap blocks in this process and the processes it starts; True where that took effect."""
    if os.environ.get("QIC_KEEP_FREED_BLOCKS", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, _LARGEST) == 1
    if ok:
        for name, value in _ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    return ok
