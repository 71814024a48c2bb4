"""A per-user record of weight files already hashed, so a 58 GB bundle is not re-hashed on every load.

A record says: this bundle's file REL, whose manifest sha256 is S, was hashed and matched while the
file had identity (device, inode, size, mtime_ns, ctime_ns). Any write to the file changes its ctime
(the kernel sets it; `touch` cannot put it back), so a file edited in place, even with its mtime
restored, no longer matches its record and is hashed again. Records live outside the bundle (bundles
may be read-only), one small file per record named by the hash of its contents, written atomically, so
concurrent loads need no lock. Stdlib only: the runtime imports it.

Records are swept as new ones are written: a record whose file is gone from where it was hashed, or no
longer has the recorded identity, can never vouch for anything again (a changed file gets a new record),
so each rebuild or edit would otherwise leave its old records behind forever. A bundle moved elsewhere
loses its records this way too; that costs one more hash of its files.

Where: $QIC_VERIFY_CACHE, else $XDG_CACHE_HOME/qic/verified, else ~/.cache/qic/verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from qic.fsutil import write_bytes_atomic

# A file changed within this long before hashing began is hashed but not recorded: file timestamps come
# from the kernel's coarse clock (a tick, at most 10 ms, behind), so a write landing in the same tick as
# our stat could leave the identity unchanged. One second covers that with a wide margin; the cost is
# only that a file written just before its first load is hashed once more on the next.
RACY_NS = 1_000_000_000


def default_dir() -> Path:
    if os.environ.get("QIC_VERIFY_CACHE"):
        return Path(os.environ["QIC_VERIFY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qic" / "verified"


def identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class VerificationCache:
    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory) if directory else default_dir()
        self._swept = False

    def _path(self, bundle_id: str, rel: str, sha256: str, st: os.stat_result) -> Path:
        body = json.dumps([bundle_id, rel, sha256, identity(st)]).encode()
        return self.directory / hashlib.sha256(body).hexdigest()

    def has(self, bundle_id: str, rel: str, sha256: str, st: os.stat_result) -> bool:
        return self._path(bundle_id, rel, sha256, st).is_file()

    def record(self, bundle_id: str, rel: str, sha256: str, path: Path, st: os.stat_result, hash_began_ns: int) -> None:
        """Record a file that just hashed to `sha256`; `st` is its stat from before hashing."""
        if st.st_ctime_ns > hash_began_ns - RACY_NS or identity(os.stat(path)) != identity(st):
            return  # changed recently or while being hashed: not trusted later, hashed again next time
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_bytes_atomic(self._path(bundle_id, rel, sha256, st), json.dumps(
                {"bundle": bundle_id, "file": rel, "sha256": sha256, "identity": identity(st),
                 "path": str(Path(path).resolve()), "verified_at": time.time()}).encode())
        except OSError:
            return  # an unwritable cache only costs the next load a re-hash
        if not self._swept:
            # Once per cache object (one load): a record is written only after hashing a whole weight
            # file, next to which listing a directory of small files costs nothing.
            self._swept = True
            self.sweep()

    def sweep(self) -> int:
        """Delete the records that can no longer match (see the module's docstring); returns how many."""
        removed = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0
        for entry in entries:
            if len(entry.name) != 64:  # a writer's temp file, or something that is not ours
                continue
            try:
                rec = json.loads(Path(entry.path).read_bytes())
                stale = "path" not in rec or identity(os.stat(rec["path"])) != rec["identity"]
            except (OSError, ValueError, TypeError, KeyError):
                # The weight file is gone, or the record is unreadable or damaged (or was just swept by a
                # concurrent load): it cannot vouch for anything.
                stale = True
            if stale:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except OSError:
                    pass  # swept by a concurrent load already, or not ours to delete
        return removed
