"""Remote compile stores a build pulls hits from before compiling (`cache_from:` / `--cache-from`).

A remote entry is native code this machine will run, so a matching hash proves nothing about who made
it: it is used only if its Ed25519 signature verifies against a configured public key, or the user
marked the store trusted. Otherwise it is refused with one line and the graph is compiled locally.
Every check (signature, hashes, toolchain identity, key) runs on the copy in local staging, never on the
remote's files, so a remote that changes between check and copy cannot slip anything in (store.adopt);
the adopted entry's origin.json records the store it came from.
"""

from __future__ import annotations

from pathlib import Path

from qic.cache import layout, signing, store
from qic.cache.hub import HubRemote, hub_repo
from qic.errors import ConfigError, warn


class DirectoryRemote:
    """Another directory store (e.g. a shared mount) used read-only by this build."""

    def __init__(self, root: Path, public_keys: list[str], trusted: bool):
        self.root, self.public_keys, self.trusted = Path(root), public_keys, trusted
        if not self.root.is_dir():
            raise ConfigError(f"cache_from {self.root}: no such directory")

    def __str__(self) -> str:
        return str(self.root)

    def fetch(self, gkey: str, cache_dir: Path, identity: dict) -> dict | None:
        """Copy a verified entry into the local store (caller holds its lock); its meta, else None."""
        src = layout.graph_dir(self.root, gkey)
        if not src.is_dir():
            return None
        return store.adopt(src, cache_dir, gkey, identity, self.public_keys, self.trusted, str(self))


def open_remote(url: str | None, public_keys=(), trusted: bool = False):
    """The remote for a `cache_from` value: hf://ORG/REPO (Hugging Face Hub) or a directory."""
    if not url:
        return None
    keys = signing.parse_public_keys(public_keys)
    if not keys and not trusted:
        warn(f"cache_from {url}: no public key configured and the store is not marked trusted, "
             "so every remote entry will be refused (set cache_public_keys or cache_trusted)")
    repo = hub_repo(url)
    if repo is not None:
        return HubRemote(repo, keys, trusted)
    return DirectoryRemote(Path(url).expanduser(), keys, trusted)
