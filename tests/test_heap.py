"""qic.runtime.heap: a process that keeps freed blocks reuses its large temporaries without faulting them in again,
on the main thread (`qic run`) and on another (`qic serve`'s runner), and a process started from it does too."""

import json
import os
import platform
import subprocess
import sys

import pytest


def _glibc() -> bool:
    # the standard library's own probe, not qic.runtime.heap.is_glibc: a broken detection there must fail, not skip
    return platform.libc_ver()[0] == "glibc"


# In a fresh interpreter (the setting is process-wide): the minor page faults of ten runs of one computation whose
# three temporaries are 64 MiB each (over glibc's 32 MiB mmap ceiling), on this thread or another, and the malloc
# variables a process started from it inherits. Transparent huge pages off for the process, so that a fault is a
# 4 KiB page wherever the test runs.
CHILD = """
import ctypes, json, os, resource, sys
from concurrent.futures import ThreadPoolExecutor
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)   # PR_SET_THP_DISABLE
import torch
from qic.runtime.heap import keep_freed_blocks
took = keep_freed_blocks()
x = torch.ones(16 * 2**20)
def runs():
    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        (x * 2 + 1).exp().sum()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults
faults = ThreadPoolExecutor(1).submit(runs).result() if sys.argv[1] == "thread" else runs()
env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
print(json.dumps({"took": took, "faults": faults, "env": env}))
"""
KEPT = {"MALLOC_TRIM_THRESHOLD_": str(2**62), "MALLOC_MMAP_MAX_": "0", "MALLOC_ARENA_MAX": "1"}


def _child(keep: str, where: str, malloc_env: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"QIC_KEEP_FREED_BLOCKS": keep}
    out = subprocess.run([sys.executable, "-c", CHILD, where], env=env | (malloc_env or {}), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _reused(faults: list[int]) -> bool:
    # Counted in the first run's faults (3 x 16384 pages, faulted in either way): the heap grows over the first few
    # runs (glibc serves c10's 64-byte-aligned requests from a freed block only once neighbours have merged into one
    # a little larger), then the runs reuse it.
    return faults[0] > 0 and sum(faults[5:]) / 5 < faults[0] / 8


@pytest.mark.skipif(not _glibc(), reason="mallopt's switches are glibc's; elsewhere keep_freed_blocks does nothing")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_process_that_keeps_freed_blocks_reuses_its_temporaries(where):
    kept = _child("1", where)
    assert kept["took"] and kept["env"] == KEPT
    assert _reused(kept["faults"]), kept["faults"]


@pytest.mark.skipif(not _glibc(), reason="glibc reads its MALLOC_ variables at start")
def test_a_process_started_with_the_variables_it_leaves_keeps_them_too():
    started = _child("0", "thread", KEPT)   # a process it starts afresh: the variables alone, no mallopt
    assert not started["took"] and _reused(started["faults"]), started["faults"]


@pytest.mark.skipif(not _glibc(), reason="mallopt's switches are glibc's")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_the_counterpart_malloc_as_it_is_faults_every_run_in_again(where):
    system = _child("0", where)
    assert not system["took"] and system["env"] == {}
    assert min(system["faults"][1:]) >= system["faults"][0] / 2, system["faults"]
