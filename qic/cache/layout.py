"""Where everything lives in a cache directory: the only module that knows its paths and memo format.

    CACHE/graphs/<graph key>/        compiled graph entries (qic.cache.store)
    CACHE/index/<spec key>           memo: spec key -> graph key (one line of text)
    CACHE/plan/{estimate,weights,traffic}-<key>.json   a graph's memory estimate, a component's weight bytes, a
                                     step's traffic (qic.builder.memplan.memo_name: keyed by what each reads)
    CACHE/shards/<component>-<key>/  per-rank weight shards (qic.builder.shard)
    CACHE/neffs/<key>/               NEFFs (the neuron back end's finish step), each locked by its own
                                     .model.neff.lock inside it
    CACHE/embedded/<preset>/         the embedded checkpoints, generated once
    CACHE/locks/{graph,shard}-<key>.lock   per-entry inter-process locks (graph-<key>.users.lock: builds
                                     using the entry; bundle-<path hash>.lock: builds writing one output)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from qic.fsutil import FileLock, file_lock, write_bytes_atomic

GRAPHS, INDEX, PLAN, SHARDS, NEFFS, EMBEDDED, LOCKS = "graphs", "index", "plan", "shards", "neffs", "embedded", "locks"
NEFF_LOCK = ".model.neff.lock"   # qic.backends.neuron.cc's lock, f".{NEFF}.lock", inside the NEFF's directory


def graphs_dir(cache: Path) -> Path:
    return Path(cache) / GRAPHS


def graph_dir(cache: Path, gkey: str) -> Path:
    return Path(cache) / GRAPHS / gkey


def graph_lock(cache: Path, gkey: str) -> FileLock:
    """The lock every reader that may repair, and every writer, of a graph entry holds."""
    return file_lock(Path(cache) / LOCKS / f"graph-{gkey}.lock")


def graph_users(cache: Path, gkey: str) -> FileLock:
    """Held shared by every build using a graph entry, from its check until it is done with the files;
    `qic cache prune` takes it (and graph_lock) exclusively without waiting, and skips an entry in use.
    A lock of its own, so that a build holding it can still take graph_lock to repair or write."""
    return file_lock(Path(cache) / LOCKS / f"graph-{gkey}.users.lock", shared=True)


def read_memo(cache: Path, skey: str) -> str | None:
    """The graph key memoised for a spec key, or None."""
    try:
        return (Path(cache) / INDEX / skey).read_text().strip() or None
    except OSError:
        return None


def write_memo(cache: Path, skey: str, gkey: str) -> None:
    write_bytes_atomic(Path(cache) / INDEX / skey, gkey.encode())


def plan_file(cache: Path, skey: str) -> Path:
    return Path(cache) / PLAN / f"{skey}.json"


def shards_dir(cache: Path) -> Path:
    return Path(cache) / SHARDS


def shard_dir(cache: Path, component: str, key: str) -> Path:
    return Path(cache) / SHARDS / f"{component}-{key}"


def shard_key_of(dirname: str) -> str:
    """The key of a shard entry's directory name, <component>-<key> (component names have no '-')."""
    return dirname.rpartition("-")[2]


def output_lock(cache: Path, output: Path) -> FileLock:
    """The lock builds writing one bundle directory take turns on (named by its absolute path)."""
    name = hashlib.sha256(str(Path(output).resolve()).encode()).hexdigest()[:32]
    return file_lock(Path(cache) / LOCKS / f"bundle-{name}.lock")


def shard_lock(cache: Path, key: str) -> FileLock:
    return file_lock(Path(cache) / LOCKS / f"shard-{key}.lock")


def neff_dir(cache: Path, key: str) -> Path:
    return Path(cache) / NEFFS / key


def neff_lock(cache: Path, key: str) -> FileLock:
    return file_lock(neff_dir(cache, key) / NEFF_LOCK)


def embedded_dir(cache: Path, preset: str) -> Path:
    return Path(cache) / EMBEDDED / preset
