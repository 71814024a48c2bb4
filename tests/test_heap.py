"""qic.runtime.heap: a process that keeps freed blocks reuses a large buffer without faulting it in again."""

import json
import os
import subprocess
import sys

import pytest

from qic.runtime.heap import _glibc

# In a fresh interpreter (the setting is process-wide): the minor page faults of ten runs of one computation whose
# three temporaries are 64 MiB each (over glibc's 32 MiB mmap ceiling), and the malloc variables ranks inherit.
CHILD = """
import json, os, resource, torch
from qic.runtime.heap import keep_freed_blocks
took = keep_freed_blocks()
x = torch.ones(16 * 2**20)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    (x * 2 + 1).exp().sum()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": faults,
                  "env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")}}))
"""


def _child(keep: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"QIC_KEEP_FREED_BLOCKS": keep}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="mallopt's switches are glibc's; elsewhere keep_freed_blocks does nothing")
def test_a_freed_buffer_is_reused_without_faulting_it_in_again():
    kept = _child("1")
    assert kept["took"] and kept["env"] == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}
    # Counted in the first run's faults, which fault its temporaries in either way (3 x 16384 pages of 4 KiB; fewer
    # under huge pages). Kept: the heap grows for the first few runs (glibc serves c10's 64-byte-aligned requests
    # from a freed block only once neighbours have merged into one a little larger), then the runs reuse it.
    first, last = kept["faults"][0], kept["faults"][5:]
    assert first > 0 and sum(last) / len(last) < first / 8
    # the counterpart, malloc left as it is: each 64 MiB block (over glibc's 32 MiB mmap ceiling) is a fresh mmap
    system = _child("0")
    assert not system["took"] and system["env"] == {"MALLOC_MMAP_MAX_": None, "MALLOC_TRIM_THRESHOLD_": None}
    assert min(system["faults"][1:]) >= system["faults"][0] / 2   # every run faults its temporaries in again
