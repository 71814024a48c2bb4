"""`qic warm` and `qic cache` presentation: tables of what was compiled, cached, failed or stored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qic.cli_build import _size


def run_warm(matrix, overrides, shard, jobs, dry_run, sign_key, report) -> None:
    from qic.build.warm import report_json, summary, warm
    total, rows = warm(matrix, overrides, shard, jobs, dry_run, sign_key)
    table = Table(title=f"qic warm {matrix} (shard {shard or '1/1'}: {len(rows)} of {total} jobs)")
    for col in ("graph", "model", "result", "size", "time"):
        table.add_column(col, justify="right" if col in ("size", "time") else "left")
    for r in rows:
        table.add_row(r.graph, r.model, r.status + (f": {r.error}" if r.error else ""), _size(r.bytes),
                      f"{r.seconds:.1f}s")
    out = Console(width=200)
    out.print(table)
    s = summary(rows)
    out.print(f"{s['hits']} hits, {s['misses']} misses ({s['compiled']} compiled, {s['failed']} failed), "
              f"compile {s['compile_seconds']:.1f}s, {_size(s['bytes'])}")
    if report:
        Path(report).write_text(json.dumps(report_json(total, rows, shard), indent=2) + "\n")
    if s["failed"]:
        sys.exit(1)


def run_cache_ls(cache_dir) -> None:
    from qic.build import store
    infos = store.entries(Path(cache_dir), hash_files=False)
    table = Table(title=f"compile cache {cache_dir}")
    for col in ("key", "graph", "size", "signed"):
        table.add_column(col)
    for e in infos:
        table.add_row(e.key, e.graph, _size(e.bytes), "yes" if e.signed else "no")
    out = Console(width=200)
    out.print(table)
    out.print(f"{len(infos)} entries, {_size(sum(e.bytes for e in infos))}")


def run_cache_verify(cache_dir) -> None:
    """Hash every entry; entries for another toolchain are listed, not counted as damage."""
    from qic.build import store
    bad = 0
    infos = store.entries(Path(cache_dir))
    for e in infos:
        if e.problem:
            bad += 1
            print(f"{e.key} {e.graph}: {e.problem}")
    print(f"{len(infos) - bad} of {len(infos)} entries intact")
    if bad:
        sys.exit(1)


def run_cache_prune(cache_dir, max_size) -> None:
    from qic.build import store
    removed = store.prune(Path(cache_dir), store.parse_size(max_size))
    for e in removed:
        print(f"removed {e.key} {e.graph} ({_size(e.bytes)})")
    left = store.entries(Path(cache_dir), hash_files=False)
    print(f"{len(removed)} entries removed; {len(left)} left, {_size(sum(e.bytes for e in left))}")


def run_cache_push(cache_dir, url) -> None:
    from qic.build.hub_store import HubRemote
    from qic.errors import ConfigError
    if not str(url).startswith("hf://"):
        raise ConfigError(f"{url}: push takes a Hub store (hf://ORG/REPO)",
                          "a directory store needs no push: point --cache-dir or --cache-from at it")
    pushed = HubRemote(url[len("hf://"):], [], False).push(Path(cache_dir))
    print(f"pushed {len(pushed)} entries to {url}")


def run_cache_pull(url, cache_dir, public_keys, trusted, device) -> None:
    from qic.backends import get_backend
    from qic.build.remote import open_remote
    from qic.errors import ConfigError
    if not str(url).startswith("hf://"):
        raise ConfigError(f"{url}: pull takes a Hub store (hf://ORG/REPO)",
                          "a directory store is read in place: use --cache-from DIR")
    remote = open_remote(url, [k for k in public_keys if k], trusted)
    ok, refused = remote.pull(Path(cache_dir), get_backend("inductor", device).identity())
    print(f"pulled {ok} entries from {url}; {refused} refused")
