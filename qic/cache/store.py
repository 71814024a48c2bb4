"""The compile cache as a store of graph entries: entry checks, sealing, adoption from a remote, ls / verify /
prune. Where entries live is qic.cache.layout's; signatures are qic.cache.signing's.

    CACHE/graphs/<graph key>/{graph.pt2, constants.safetensors, meta.json, signature.json, done}

An entry is written into a staging directory and renamed into place; `done` is written last, so a
reader on a shared mount that shows the rename before the files trusts nothing without it. An entry
is used only if it is complete, every file matches its recorded sha256, and it was recorded for this
toolchain and machine (the identity in meta.json); anything else is reported with a warning naming
it, set aside and rebuilt. Failures are never cached: a failed compile leaves only its staging dir.

Entries compiled by `qic warm` with a signing key carry an Ed25519 signature over meta.json (which
holds every file's sha256); entries from a remote store are used only if that signature verifies
against a configured public key, or the store is marked trusted (qic.cache.remote).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from qic.cache import layout
from qic.cache.signing import SIGNATURE, sign, signature_problem
from qic.errors import ConfigError, warn
from qic.fsutil import staging_dir, write_bytes_atomic, write_json_atomic
from qic.manifest import sha256_file

DONE = "done"
META = "meta.json"


# ---- sealing and checking -------------------------------------------------------------------------

def seal(tmp: Path, meta: dict, private_key=None) -> None:
    """Finish a staged entry: meta.json, the signature when a key is given, the completion marker last."""
    write_json_atomic(tmp / META, meta)
    if private_key is not None:
        write_json_atomic(tmp / SIGNATURE, sign(meta, private_key))
    write_bytes_atomic(tmp / DONE, b"")


def check_entry(d: Path, identity: dict | None = None) -> tuple[str | None, dict | None]:
    """(problem, meta): problem is None for a complete, intact entry recorded for `identity`."""
    if not (d / DONE).is_file():
        return "incomplete (no completion marker)", None
    try:
        meta = json.loads((d / META).read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "corrupted (meta.json unreadable)", None
    for f, entry in files.items():
        if not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".") or f in (META, SIGNATURE, DONE):
            return f"corrupted (file name {str(f)[:40]!r} is not a plain artifact name)", None
        p = d / f
        try:
            if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
                return f"corrupted ({f} does not match its recorded sha256)", meta
        except OSError:
            return f"corrupted ({f} is missing)", meta
    if identity is not None and meta.get("backend") != identity:
        return f"recorded for another toolchain or machine ({differences(meta.get('backend'), identity)})", meta
    return None, meta


def differences(recorded, current) -> str:
    """What differs between a recorded identity and this one, briefly: 'torch 2.12.0 (here 2.13.0)'."""
    if not isinstance(recorded, dict):
        return "no identity recorded"
    out = []
    for k in sorted(set(recorded) | set(current)):
        a, b = recorded.get(k), current.get(k)
        if a == b:
            continue
        if k == "target" and isinstance(a, dict) and isinstance(b, dict):
            for tk in sorted(set(a) | set(b)):
                ta, tb = a.get(tk), b.get(tk)
                if ta == tb:
                    continue
                if tk == "isa":
                    extra, lacking = sorted(set(ta or ()) - set(tb or ())), sorted(set(tb or ()) - set(ta or ()))
                    out.append("instruction set " + " ".join([f"+{f}" for f in extra] + [f"-{f}" for f in lacking])
                               + " vs this machine")
                else:
                    out.append(f"{tk} {ta} (here {tb})")
        else:
            out.append(f"{k} {a} (here {b})")
    return "; ".join(out)


def lookup(cache_dir: Path, gkey: str, identity: dict, quiet: bool = False) -> dict | None:
    """The meta of a usable entry, else None. Not quiet (call it holding the entry's lock): a bad entry
    is reported and set aside so that the rebuild takes its place."""
    d = layout.graph_dir(cache_dir, gkey)
    if not d.is_dir():
        return None
    problem, meta = check_entry(d, identity)
    if problem is None:
        _touch(d / DONE)
        return meta
    if not quiet:
        warn(f"cache entry {d}: {problem}; ignoring it and rebuilding")
        set_aside(d)
    return None


def adopt(src: Path, cache_dir: Path, gkey: str, identity: dict, public_keys, trusted, where: str) -> dict | None:
    """Copy a remote entry that verifies (hashes, identity, signature unless trusted) into the local store
    (the caller holds the entry's lock); its meta, else None with one warning line."""
    problem, meta = check_entry(src, identity)
    if problem is None and not trusted:
        problem = signature_problem(src, meta, public_keys)
    if problem is None and meta.get("key") != gkey:
        problem = f"it is recorded as entry {meta.get('key')}"
    if problem:
        warn(f"{where}: remote entry {gkey} refused: {problem}; compiling it locally")
        return None
    with staging_dir(layout.graph_dir(cache_dir, gkey)) as tmp:
        for f in [*meta["files"], META, SIGNATURE]:
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
        (tmp / DONE).write_bytes(b"")
    return lookup(cache_dir, gkey, identity)


def set_aside(d: Path) -> Path | None:
    """Move an entry out of the way (never read again); sweep_stale removes it once this process is gone."""
    aside = d.with_name(f".tmp-{d.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(d, aside)
    except FileNotFoundError:
        return None
    return aside


def _touch(p: Path) -> None:
    try:
        os.utime(p)  # last use, for prune's least-recently-used order
    except OSError:
        pass


# ---- ls / verify / prune ---------------------------------------------------------------------------

@dataclass
class EntryInfo:
    key: str
    path: Path
    graph: str
    bytes: int
    problem: str | None
    signed: bool
    last_used: float


def entries(cache_dir: Path, identity: dict | None = None, hash_files: bool = True) -> list[EntryInfo]:
    """Every entry of a directory store (complete or not), with its problem if any."""
    out = []
    root = layout.graphs_dir(cache_dir)
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if d.name.startswith(".") or not d.is_dir():
            continue
        if hash_files:
            problem, meta = check_entry(d, identity)
        else:
            problem, meta = None, None
            try:
                meta = json.loads((d / META).read_text())
            except (OSError, ValueError):
                problem = "corrupted (meta.json unreadable)"
        size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
        done = d / DONE
        out.append(EntryInfo(d.name, d, (meta or {}).get("graph", "?"), size, problem, (d / SIGNATURE).is_file(),
                             done.stat().st_mtime if done.is_file() else 0.0))
    return out


def prune(cache_dir: Path, max_bytes: int) -> list[EntryInfo]:
    """Remove least recently used entries until the store holds at most `max_bytes`; returns them."""
    infos = sorted(entries(cache_dir, hash_files=False), key=lambda e: e.last_used)
    total = sum(e.bytes for e in infos)
    removed = []
    for e in infos:
        if total <= max_bytes:
            break
        with layout.graph_lock(cache_dir, e.key):
            aside = set_aside(e.path)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        total -= e.bytes
        removed.append(e)
    return removed


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
             "T": 1 << 40, "TB": 1 << 40}
    s = str(text).strip().upper()
    num = s.rstrip("KMGTB")
    try:
        return int(float(num) * units[s[len(num):]])
    except (ValueError, KeyError):
        raise ConfigError(f"--max-size {text!r} is not a size (e.g. 500M, 20G)") from None
