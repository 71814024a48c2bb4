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
# Its loaded graphs run over other weights per call (the load's `rebind`): LoRA slots filled per request (qic.spec).
REBINDS_WEIGHTS = True
# Its graphs compile in a build's compile workers (qic.builder.workers) where they hold no collectives.
COMPILES_IN_WORKERS = True
# Build-config keys only this back end takes, with their allowed values (qic/spec.py refuses them elsewhere).
OPTIONS = {"cpu_target": CPU_TARGETS}
# The instruction sets of CPUs with bf16 matrix units (AVX512-BF16's dot products, AMX's tiles): where the build's CPU
# code targets one, bf16 is what its text encoder and denoiser run at by default (qic.spec).
BF16_UNITS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_units(device: str, cpu_target: str | None) -> bool:
    """Whether graphs built for `device` and `cpu_target` run on CPUs with bf16 units: a CPU build asked for this
    host (cpu_target native) on a host with them. The x86-64 levels (portable, auto, v3, v4) promise none, so their
    builds stay fp32, which runs at full speed everywhere, also where portable falls back to native on a host
    that fits no level."""
    from qic.backends.inductor import target as cpu
    return device == "cpu" and cpu_target == "native" and bool(BF16_UNITS & set(cpu.host_isa()))

# qic's own post-grad pass for CPU graphs (why: in that file). Keyed by its source's digest, read without
# importing it: importing inductor's pass base class costs a second on no-op builds. The file's bytes are
# kept as they were before the layout moved it, so every compiled graph's key stays the same.
PASSES_FILE = Path(__file__).with_name("passes.py")


def passes_digest() -> str:
    return hashlib.sha256(PASSES_FILE.read_bytes()).hexdigest()[:16]
