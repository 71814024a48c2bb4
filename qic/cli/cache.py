"""`qic cache ls | verify | prune | push | pull | keygen`: a compile cache's entries, kept and shared."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qic.cache import store
from qic.cache.hub import hub_repo
from qic.cli.tables import size
from qic.errors import ConfigError


def run_cache_ls(cache_dir) -> None:
    infos = store.entries(Path(cache_dir), hash_files=False)
    table = Table(title=f"compile cache {cache_dir}")
    for col in ("key", "graph", "size", "signed"):
        table.add_column(col)
    for e in infos:
        table.add_row(e.key, e.graph, size(e.bytes), "yes" if e.signed else "no")
    out = Console(width=200)
    out.print(table)
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


def run_cache_prune(cache_dir, max_size) -> None:
    removed = store.prune(Path(cache_dir), store.parse_size(max_size))
    for e in removed:
        print(f"removed {e.key} {e.graph} ({size(e.bytes)})")
    left = store.entries(Path(cache_dir), hash_files=False)
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
