"""The compile cache as a store of graph entries: entry checks, sealing, adoption from a remote, ls / verify /
prune. Where entries live is qic.cache.layout's; signatures are qic.cache.signing's.

    CACHE/graphs/<graph key>/{graph.pt2, constants.safetensors, meta.json, signature.json, done}
                              (+ origin.json in an entry adopted from a remote store)

An entry is written into a staging directory and renamed into place; every file is flushed to disk before
`done` is written last, so neither a reader on a shared mount that shows the rename before the files nor
a crash leaves a marked entry with missing data. An entry is used only if it is complete, every file
matches its recorded sha256, and it was recorded for this toolchain and machine (the identity in
meta.json); anything else is reported with a warning naming it, set aside and rebuilt. Failures are never
cached: a failed compile leaves only its staging dir.

Entries compiled by `qic warm` with a signing key carry an Ed25519 signature over meta.json (which
holds every file's sha256); entries from a remote store are used only if that signature verifies
against a configured public key, or the store is marked trusted (qic.cache.remote).

`prune` covers every kind of thing a cache directory holds (graphs, shards, NEFFs, memos, plans, locks
and what killed writers left), least recently used first, and never what a live build holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from qic.cache import layout
from qic.cache.signing import SIGNATURE, sign, signature_problem
from qic.errors import ConfigError, warn
from qic.fsutil import (
    STALE_SECONDS,
    FileLock,
    abandoned,
    fsync_path,
    idle_for,
    leftover_name,
    leftover_owner,
    remove_path,
    staging_dir,
    sweep_stale,
    write_bytes_atomic,
    write_json_atomic,
)
from qic.manifest import sha256_file

DONE = "done"
META = "meta.json"
ORIGIN = "origin.json"   # where an adopted entry came from; outside meta.json, which the signature covers
_RESERVED = (META, SIGNATURE, DONE, ORIGIN)


# ---- sealing and checking -------------------------------------------------------------------------

def seal(tmp: Path, meta: dict, private_key=None) -> None:
    """Finish a staged entry: meta.json, the signature when a key is given, the completion marker last."""
    write_json_atomic(tmp / META, meta)
    if private_key is not None:
        write_json_atomic(tmp / SIGNATURE, sign(meta, private_key))
    _mark_done(tmp)


def _mark_done(tmp: Path) -> None:
    """`done`, once every file and the directory's names are on disk: after a crash a marked entry is whole."""
    for p in tmp.iterdir():
        if p.is_file():
            fsync_path(p)
    fsync_path(tmp)
    write_bytes_atomic(tmp / DONE, b"")
    fsync_path(tmp)


def _plain_name(f) -> bool:
    """An artifact file name that stays inside its entry and is none of the entry's own files."""
    return isinstance(f, str) and bool(f) and "/" not in f and "\\" not in f and not f.startswith(".") \
        and f not in _RESERVED


def check_entry(d: Path, identity: dict | None = None, need_done: bool = True) -> tuple[str | None, dict | None]:
    """(problem, meta): problem is None for a complete, intact entry recorded for `identity`."""
    if need_done and not (d / DONE).is_file():
        return "incomplete (no completion marker)", None
    try:
        meta = json.loads((d / META).read_text())
        files = meta["files"]
        items = list(files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "corrupted (meta.json unreadable)", None
    for f, entry in items:
        if not _plain_name(f):
            return f"corrupted (file name {str(f)[:40]!r} is not a plain artifact name)", None
        p = d / f
        try:
            if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
                return f"corrupted ({f} does not match its recorded sha256)", meta
        except OSError:
            return f"corrupted ({f} is missing)", meta
        except (KeyError, TypeError):
            return "corrupted (meta.json unreadable)", None
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


class _Refused(Exception):
    pass


def adopt(src: Path, cache_dir: Path, gkey: str, identity: dict, public_keys, trusted, where: str) -> dict | None:
    """Adopt a remote entry into the local store (the caller holds the entry's lock); its meta, else None
    with one warning line.

    Its files are copied into local staging first and everything is verified there (hashes, identity,
    the signature unless trusted, the key), so what is published is exactly what was verified, whatever
    the remote does meanwhile. `origin.json` records where it came from."""
    try:
        with staging_dir(layout.graph_dir(cache_dir, gkey)) as tmp:
            problem = _copy_in(src, tmp)
            meta = None
            if problem is None:
                problem, meta = check_entry(tmp, identity, need_done=False)
            if problem is None and not trusted:
                problem = signature_problem(tmp, meta, public_keys)
            if problem is None and meta.get("key") != gkey:
                problem = f"it is recorded as entry {meta.get('key')}"
            if problem:
                raise _Refused(problem)
            write_json_atomic(tmp / ORIGIN, {"adopted_from": where, "adopted_at": round(time.time()),
                                             "signature_checked": not trusted})
            _mark_done(tmp)
    except _Refused as e:
        warn(f"{where}: remote entry {gkey} refused: {e}; compiling it locally")
        return None
    return lookup(cache_dir, gkey, identity)


def _copy_in(src: Path, tmp: Path) -> str | None:
    """Copy a remote entry's meta, signature and listed artifact files into `tmp`; a problem, else None.
    Names that are not plain artifact names are not copied (check_entry then refuses the entry)."""
    if not (src / DONE).is_file():
        return "incomplete (no completion marker)"
    for f in (META, SIGNATURE):
        if (src / f).is_file():
            shutil.copyfile(src / f, tmp / f)
    try:
        names = list(json.loads((tmp / META).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return "corrupted (meta.json unreadable)"
    for f in names:
        if _plain_name(f) and (src / f).is_file():
            shutil.copyfile(src / f, tmp / f)
    return None


def set_aside(d: Path) -> Path | None:
    """Move an entry out of the way (never read again); sweep_stale removes it once this process is gone."""
    aside = d.with_name(leftover_name(".tmp", d.name, str(time.monotonic_ns())))
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

LEFTOVER = "leftover"   # the kind of what killed writers (staging, set-aside entries, killed pulls) left


@dataclass
class EntryInfo:
    key: str
    path: Path
    graph: str            # graphs: the graph's name; shards: the component; index: the graph key; else ""
    bytes: int
    problem: str | None
    signed: bool
    last_used: float
    kind: str = layout.GRAPHS


def entries(cache_dir: Path, identity: dict | None = None, hash_files: bool = True) -> list[EntryInfo]:
    """Every graph entry of a directory store (complete or not), with its problem if any."""
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
        graph = meta.get("graph", "?") if isinstance(meta, dict) else "?"
        out.append(EntryInfo(d.name, d, graph, size, problem, (d / SIGNATURE).is_file(),
                             done.stat().st_mtime if done.is_file() else 0.0))
    return out


def cache_entries(cache_dir: Path) -> list[EntryInfo]:
    """Everything a cache directory holds, by kind (layout's names, plus `leftover`), without hashing.

    Last use: a graph's `done` (lookups touch it), a shard entry's meta.json (hits touch it), a NEFF's newest
    file (NEFF hits touch nothing, so that is its compile time), a memo's or lock's own mtime."""
    cache_dir = Path(cache_dir)
    out = entries(cache_dir, hash_files=False)
    for d in _children(layout.shards_dir(cache_dir)):
        if d.is_dir() and not d.name.startswith("."):
            meta = _json(d / META)
            out.append(EntryInfo(d.name, d, str(meta.get("component", "?")), _size(d), None, False,
                                 _mtime(d / META) or _newest(d), layout.SHARDS))
    for d in _children(Path(cache_dir) / layout.NEFFS):
        if d.is_dir() and not d.name.startswith("."):
            out.append(EntryInfo(d.name, d, "", _size(d), None, False, _newest(d), layout.NEFFS))
    for p in _children(cache_dir / layout.INDEX):
        if p.is_file() and not p.name.startswith("."):
            out.append(EntryInfo(p.name, p, layout.read_memo(cache_dir, p.name) or "", _size(p), None, False,
                                 _mtime(p), layout.INDEX))
    for p in _children(cache_dir / layout.PLAN):
        if p.is_file() and not p.name.startswith("."):
            out.append(EntryInfo(p.name.removesuffix(".json"), p, "", _size(p), None, False, _mtime(p), layout.PLAN))
    for p in _children(cache_dir / layout.LOCKS):
        if p.is_file() and p.name.endswith(".lock") and not p.name.startswith("."):
            out.append(EntryInfo(p.name.removesuffix(".lock"), p, "", _size(p), None, False, _mtime(p), layout.LOCKS))
    for d in _children(cache_dir / layout.EMBEDDED):
        if d.is_dir():
            out.append(EntryInfo(d.name, d, "", _size(d), None, False, _newest(d), layout.EMBEDDED))
    for p in _leftovers(cache_dir):
        out.append(EntryInfo(p.name, p, p.parent.name, _size(p), None, False, _newest(p), LEFTOVER))
    return out


def _leftovers(cache_dir: Path) -> list[Path]:
    """Staging and set-aside directories (`fsutil.leftover_name`: builds, killed `qic cache pull`s) and
    `write_bytes_atomic`'s temp files in the cache's directories (not inside NEFF entries: those count as
    part of the entry, and prune sweeps them there)."""
    dirs = [cache_dir / k for k in (layout.GRAPHS, layout.SHARDS, layout.NEFFS, layout.INDEX, layout.PLAN,
                                    layout.LOCKS)]
    return [p for d in dirs for p in _children(d)
            if leftover_owner(p.name) is not None or (p.name.startswith(".") and p.name.endswith(".tmp"))]


def _leftover_gone(p: Path) -> bool:
    owner = leftover_owner(p.name)
    return abandoned(p, owner) if owner is not None else idle_for(p, STALE_SECONDS)  # no owner recorded


def prune(cache_dir: Path, max_bytes: int | None = None, older_than: float | None = None) -> list[EntryInfo]:
    """Remove what a cache no longer needs; returns what was removed.

    - leftovers whose writer is gone (by fsutil's ownership rules: another host's only when long idle);
    - graph, shard and NEFF entries, least recently used first: those unused for more than `older_than`
      seconds, then more until the cache holds at most `max_bytes` (embedded checkpoints are neither
      counted nor removed). An entry is removed only while holding its lock, taken without waiting: one
      a live build holds (compiling, or using it: builds hold graph entries shared) is skipped;
    - memos (index/) naming graph entries that are gone, and the plans (plan/) of the memos removed (an older
      cache's plan/<spec key>.json); the plan's figures (plan/{estimate,weights,traffic}-<key>.json, keyed by what
      they read, with no memo) when unused for more than `older_than`; lock files of entries that are gone,
      unless held.
    """
    cache_dir = Path(cache_dir)
    now = time.time()
    infos = cache_entries(cache_dir)
    removed = []
    for e in infos:
        if e.kind == LEFTOVER and _leftover_gone(e.path):
            remove_path(e.path)
            removed.append(e)
    for e in infos:
        if e.kind == layout.NEFFS:   # a killed neuronx-cc run's work directory inside an entry
            sweep_stale(e.path)
    total = sum(e.bytes for e in infos if e.kind != layout.EMBEDDED) - sum(e.bytes for e in removed)
    for e in sorted((e for e in infos if e.kind in (layout.GRAPHS, layout.SHARDS, layout.NEFFS)),
                    key=lambda e: e.last_used):
        old = older_than is not None and e.last_used < now - older_than
        if not old and (max_bytes is None or total <= max_bytes):
            break
        if _remove_entry(cache_dir, e):
            total -= e.bytes
            removed.append(e)
    removed += _remove_dependents(cache_dir, infos, older_than, now)
    return removed


def _entry_locks(cache_dir: Path, e: EntryInfo) -> list[FileLock]:
    """The locks that keep an entry: its writers' lock, and for a graph the lock its users hold shared."""
    if e.kind == layout.GRAPHS:
        return [layout.graph_lock(cache_dir, e.key), FileLock(layout.graph_users(cache_dir, e.key).path)]
    if e.kind == layout.SHARDS:
        return [layout.shard_lock(cache_dir, layout.shard_key_of(e.key))]
    return [layout.neff_lock(cache_dir, e.key)]


def _remove_entry(cache_dir: Path, e: EntryInfo) -> bool:
    """Remove an entry holding its locks, taken without waiting; False if a live build holds one."""
    locks = _entry_locks(cache_dir, e)
    held = []
    try:
        for lock in locks:
            if not lock.acquire(blocking=False):
                return False
            held.append(lock)
        aside = set_aside(e.path)   # one rename: no reader ever sees half an entry
        if aside is None:
            return False
        shutil.rmtree(aside, ignore_errors=True)
        if e.kind != layout.NEFFS:   # a NEFF's lock file went with its directory
            for lock in held:
                lock.unlink()
        return True
    finally:
        for lock in held:
            lock.release()


def _remove_dependents(cache_dir: Path, infos: list[EntryInfo], older_than: float | None, now: float):
    """Memos naming removed graph entries, their plans (and old plans without a memo), orphaned unheld locks."""
    out = []
    gone_memos = set()
    for e in infos:
        if e.kind == layout.INDEX and not layout.graph_dir(cache_dir, e.graph).is_dir():
            remove_path(e.path)
            gone_memos.add(e.key)
            out.append(e)
    for e in infos:
        if e.kind != layout.PLAN:
            continue
        orphan_old = (older_than is not None and e.last_used < now - older_than
                      and not (cache_dir / layout.INDEX / e.key).is_file())
        if e.key in gone_memos or orphan_old:
            remove_path(e.path)
            out.append(e)
    shard_keys = {layout.shard_key_of(d.name) for d in _children(layout.shards_dir(cache_dir)) if d.is_dir()}
    for e in infos:
        if e.kind != layout.LOCKS or not e.path.exists():   # gone: unlinked with its entry above
            continue
        kind, _, key = e.key.partition("-")
        key = key.partition(".")[0]   # graph-<key>.users
        if kind not in ("graph", "shard") or (layout.graph_dir(cache_dir, key).is_dir() if kind == "graph"
                                              else key in shard_keys):
            continue
        lock = FileLock(e.path)
        if lock.acquire(blocking=False):   # else held: a build is writing (or using) that entry right now
            try:
                lock.unlink()
                out.append(e)
            finally:
                lock.release()
    return out


def _children(d: Path) -> list[Path]:
    try:
        return sorted(d.iterdir())
    except OSError:
        return []


def _json(p: Path) -> dict:
    try:
        v = json.loads(p.read_text())
        return v if isinstance(v, dict) else {}
    except (OSError, ValueError):
        return {}


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _size(p: Path) -> int:
    if not p.is_dir() or p.is_symlink():
        try:
            return p.lstat().st_size
        except OSError:
            return 0
    total = 0
    for root, _dirs, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _newest(p: Path) -> float:
    newest = _mtime(p)
    for root, _dirs, files in os.walk(p):
        for f in files:
            newest = max(newest, _mtime(Path(root) / f))
    return newest


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
             "T": 1 << 40, "TB": 1 << 40}
    s = str(text).strip().upper()
    num = s.rstrip("KMGTB")
    try:
        return int(float(num) * units[s[len(num):]])
    except (ValueError, KeyError):
        raise ConfigError(f"--max-size {text!r} is not a size (e.g. 500M, 20G)") from None


def parse_duration(text: str) -> float:
    """Seconds in '7d', '12h', '30m', '45s' or '2w'."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", str(text).strip().lower())
    if not m:
        raise ConfigError(f"--older-than {text!r} is not a duration (e.g. 7d, 12h, 30m)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
