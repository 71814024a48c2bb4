"""The inductor back end: torch.export + AOTInductor, one weight-free .pt2 package per graph, for CPU or CUDA.

    build.py    the build half (trace = torch.export, compile = AOTInductor), qic's passes in passes.py
    load.py     the run half (the C++ package loader; refuses a graph compiled for another machine)
    target.py   the machine a graph was compiled for (instruction set, GPU), and whether this one can run it

This file stays light (no torch): the registry reads the devices here, and passes.py reads passes_digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from qic.backends.inductor.target import CPU_TARGETS  # stdlib only

NAME = "inductor"
DEVICES = ("cpu", "cuda")
DEFAULT_DEVICE = "cpu"
RUN_DEVICES = DEVICES
# Its graphs may take a dynamic text length: a build without text buckets then gets exact-length text (qic.spec).
DYNAMIC_TEXT = True
# Its graphs compile in a build's compile workers (qic.builder.workers) where they hold no collectives.
COMPILES_IN_WORKERS = True
# Build-config keys only this back end takes, with their allowed values (qic/spec.py refuses them elsewhere).
OPTIONS = {"cpu_target": CPU_TARGETS}

# qic's own post-grad pass for CPU graphs (why: in that file). Keyed by its source's digest, read without
# importing it: importing inductor's pass base class costs a second on no-op builds. The file's bytes are
# kept as they were before the layout moved it, so every compiled graph's key stays the same.
PASSES_FILE = Path(__file__).with_name("passes.py")


def passes_digest() -> str:
    return hashlib.sha256(PASSES_FILE.read_bytes()).hexdigest()[:16]
