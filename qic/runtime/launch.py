"""Starting the ranks a bundle asks for, shared by `qic run` and `qic serve`: the bundle's TP degree against
--tp and torchrun's world, then one process (tp=1), this process as one torchrun rank, or tp ranks spawned
on loopback with the cores shared among them."""

from __future__ import annotations

import os
from pathlib import Path

from qic.errors import ConfigError
from qic.manifest import read_manifest


def bundle_tp(bundle_path: str | Path, asked: int | None, verb: str) -> int:
    """The TP degree the bundle was built for; --tp, when given, must equal it."""
    built = read_manifest(Path(bundle_path))["tp"]
    if asked is not None and asked != built:
        raise ConfigError(f"--tp {asked} asked for, but the bundle was built for tp={built}",
                          f"{verb} with --tp {built} or rebuild with --tp {asked}")
    return built


def torchrun_world() -> int | None:
    """WORLD_SIZE when torchrun launched this process (it is then one rank), else None."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def spawn_ranks(fn, tp: int, *args, timeout: float | None, notify: int | None = None) -> list:
    """fn(rank, tp, *args) in tp fresh processes on loopback, the machine's cores split between them
    (timeout and notify: qic.parallel.ranks.spawn's)."""
    from qic.parallel.ranks import spawn
    threads = max(1, (os.cpu_count() or 1) // tp)
    return spawn(fn, tp, *args, threads=threads, timeout=timeout, notify=notify)
