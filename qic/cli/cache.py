"""`qic cache ls | verify | prune | push | pull | keygen`: a compile cache's entries, kept and shared."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qic.cache import layout, store
from qic.cache.hub import hub_repo
from qic.cli.tables import size
from qic.errors import ConfigError


def run_cache_ls(cache_dir) -> None:
    """Every kind of thing the cache holds (graphs, shards, NEFFs, memos, plans, locks, leftovers, the embedded
    checkpoints), least recently used first within a kind, and each kind's total."""
    infos = sorted(store.cache_entries(Path(cache_dir)), key=lambda e: (e.kind, e.last_used, e.key))
    table = Table(title=f"compile cache {cache_dir}")
    for col in ("kind", "key", "detail", "size", "signed"):   # detail: graph name, component, memo's target
        table.add_column(col, justify="right" if col == "size" else "left")
    for e in infos:
        table.add_row(e.kind, e.key, e.graph, size(e.bytes),
                      ("yes" if e.signed else "no") if e.kind == layout.GRAPHS else "")
    out = Console(width=200)
    out.print(table)
    for kind in sorted({e.kind for e in infos}):
        mine = [e for e in infos if e.kind == kind]
        out.print(f"{kind}: {len(mine)}, {size(sum(e.bytes for e in mine))}")
    out.print(f"{len(infos)} entries, {size(sum(e.bytes for e in infos))}")


def run_cache_verify(cache_dir) -> None:
    """Hash every entry; entries for another toolchain are listed, not counted as damage."""
    bad = 0
    infos = store.entries(Path(cache_dir))
    for e in infos:
        if e.problem:
            bad += 1
            print(f"{e.key} {e.graph}: {e.problem}")
    print(f"{len(infos) - bad} of {len(infos)} entries intact")
    if bad:
        sys.exit(1)


def run_cache_prune(cache_dir, max_size, older_than) -> None:
    if max_size is None and older_than is None:
        raise ConfigError("qic cache prune needs --max-size or --older-than (or both)",
                          "e.g. `qic cache prune DIR --older-than 7d` or `qic cache prune DIR --max-size 50G`")
    max_bytes = store.parse_size(max_size) if max_size is not None else None
    seconds = store.parse_duration(older_than) if older_than is not None else None
    removed = store.prune(Path(cache_dir), max_bytes, seconds)
    for e in removed:
        print(f"removed {e.key} {e.kind}{' ' + e.graph if e.graph else ''} ({size(e.bytes)})")
    left = [e for e in store.cache_entries(Path(cache_dir)) if e.kind != layout.EMBEDDED]
    print(f"{len(removed)} entries removed; {len(left)} left, {size(sum(e.bytes for e in left))}")


def run_cache_push(cache_dir, url) -> None:
    from qic.cache.hub import HubRemote
    repo = hub_repo(url)
    if repo is None:
        raise ConfigError(f"{url}: push takes a Hub store (hf://ORG/REPO)",
                          "a directory store needs no push: point --cache-dir or --cache-from at it")
    pushed = HubRemote(repo, [], False).push(Path(cache_dir))
    print(f"pushed {len(pushed)} entries to {url}")


def run_cache_pull(url, cache_dir, public_keys, trusted, device) -> None:
    from qic.backends import for_device, get_backend
    from qic.cache.remote import open_remote
    if hub_repo(url) is None:
        raise ConfigError(f"{url}: pull takes a Hub store (hf://ORG/REPO)",
                          "a directory store is read in place: use --cache-from DIR")
    remote = open_remote(url, [k for k in public_keys if k], trusted)
    ok, refused = remote.pull(Path(cache_dir), get_backend(for_device(device), device).identity())
    print(f"pulled {ok} entries from {url}; {refused} refused")


def run_cache_keygen(keyfile) -> None:
    from qic.cache.signing import keygen
    pub_path, pub = keygen(keyfile)
    print(f"private key: {keyfile}\npublic key:  {pub_path} ({pub})")
