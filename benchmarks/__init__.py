"""Benchmarks: runnable modules (`python -m benchmarks.<name>`), not tests; results go to docs/benchmarks.md.

Each takes `--smoke`: the same code path at the smallest sizes, to prove it still runs (tests/test_benchmarks.py
runs every one that way); its figures mean nothing.
"""

from __future__ import annotations

import argparse

SMOKE_HELP = "the same code path at the smallest sizes, to prove that it runs (figures meaningless)"


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None, smoke: dict) -> argparse.Namespace:
    """Parse with a --smoke flag whose settings replace the defaults; flags given explicitly still win."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**smoke)
        args = ap.parse_args(argv)
    return args


_TEMP_DIRS: list = []


def smoke_dir(name: str):
    """A temporary work directory for a smoke run, removed when the process exits."""
    import tempfile
    from pathlib import Path
    tmp = tempfile.TemporaryDirectory(prefix=f"qic-smoke-{name}-")
    _TEMP_DIRS.append(tmp)
    return Path(tmp.name)


def timed_ranks(run, rank: int, warmup: int, steps: int) -> dict:
    """One rank's timing loop: `warmup` untimed calls, then `steps` timed ones, each after a barrier so the ranks
    start together; rank 0 keeps its last output."""
    import time

    import torch.distributed as dist
    for _ in range(warmup):
        out = run()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return {"times": times, "out": out if rank == 0 else None}
