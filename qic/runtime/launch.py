"""Starting the ranks a bundle asks for, shared by `qic run` and `qic serve`: the bundle's layout (its TP degree
against --tp) and torchrun's world, then one process (world 1), this process as one torchrun rank, or the
world's ranks forked on loopback with the cores shared among them."""

from __future__ import annotations

import os
from pathlib import Path

from qic.errors import ConfigError
from qic.manifest import read_bundle
from qic.parallel.mesh import Layout


def bundle_world(bundle_path: str | Path, asked: int | None, verb: str) -> int:
    """The ranks the bundle's layout asks for (tp x ulysses x cfg, qic/parallel/mesh.py); --tp, when given,
    must equal the bundle's TP degree."""
    manifest = read_bundle(Path(bundle_path))
    built = manifest["tp"]
    if asked is not None and asked != built:
        raise ConfigError(f"--tp {asked} asked for, but the bundle was built for tp={built}",
                          f"{verb} with --tp {built} or rebuild with --tp {asked}")
    return Layout.of_manifest(manifest).world


def torchrun_world() -> int | None:
    """WORLD_SIZE when torchrun launched this process (it is then one rank), else None."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def spawn_ranks(fn, tp: int, *args, timeout: float | None, notify: int | None = None) -> list:
    """fn(rank, tp, *args) in tp processes on loopback, the machine's cores split between them (timeout and
    notify: qic.parallel.ranks.spawn's). Forked from this process, which has run no torch computation: `qic run`
    and `qic serve` start their ranks before loading anything, so each rank starts in milliseconds, not the
    seconds a fresh interpreter takes to import torch."""
    from qic.parallel.ranks import spawn
    threads = max(1, (os.cpu_count() or 1) // tp)
    return spawn(fn, tp, *args, threads=threads, timeout=timeout, notify=notify, start="fork")
