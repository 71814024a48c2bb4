"""Where everything lives in a cache directory: the only module that knows its paths and memo format.

    CACHE/graphs/<graph key>/        compiled graph entries (qic.cache.store)
    CACHE/index/<spec key>           memo: spec key -> graph key (one line of text)
    CACHE/plan/<spec key>.json       a graph's memory estimate (qic.builder.memplan)
    CACHE/shards/<component>-<key>/  per-rank weight shards (qic.builder.shard)
    CACHE/neffs/<key>/               NEFFs (the neuron back end's finish step)
    CACHE/embedded/<preset>/         the embedded checkpoints, generated once
    CACHE/locks/{graph,shard}-<key>.lock   per-entry inter-process locks
"""

from __future__ import annotations

from pathlib import Path

from qic.fsutil import file_lock, write_bytes_atomic

GRAPHS, INDEX, PLAN, SHARDS, NEFFS, EMBEDDED, LOCKS = "graphs", "index", "plan", "shards", "neffs", "embedded", "locks"


def graphs_dir(cache: Path) -> Path:
    return Path(cache) / GRAPHS


def graph_dir(cache: Path, gkey: str) -> Path:
    return Path(cache) / GRAPHS / gkey


def graph_lock(cache: Path, gkey: str):
    """The lock every reader that may repair, and every writer, of a graph entry holds."""
    return file_lock(Path(cache) / LOCKS / f"graph-{gkey}.lock")


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


def shard_lock(cache: Path, key: str):
    return file_lock(Path(cache) / LOCKS / f"shard-{key}.lock")


def neff_dir(cache: Path, key: str) -> Path:
    return Path(cache) / NEFFS / key


def embedded_dir(cache: Path, preset: str) -> Path:
    return Path(cache) / EMBEDDED / preset
