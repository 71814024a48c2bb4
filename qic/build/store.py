"""The compile cache as a store of graph entries: entry checks, sealing, signatures, ls / verify / prune.

    CACHE/graphs/<graph key>/{graph.pt2, constants.safetensors, meta.json, signature.json, done}
    CACHE/index/<spec key>          memo: spec key -> graph key
    CACHE/locks/graph-<key>.lock    per-entry inter-process lock

An entry is written into a staging directory and renamed into place; `done` is written last, so a
reader on a shared mount that shows the rename before the files trusts nothing without it. An entry
is used only if it is complete, every file matches its recorded sha256, and it was recorded for this
toolchain and machine (the identity in meta.json); anything else is reported with a warning naming
it, set aside and rebuilt. Failures are never cached: a failed compile leaves only its staging dir.

Entries compiled by `qic warm` with a signing key carry an Ed25519 signature over meta.json (which
holds every file's sha256); entries from a remote store are used only if that signature verifies
against a configured public key, or the store is marked trusted (qic.build.remote).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qic.errors import ConfigError
from qic.fsutil import file_lock, write_bytes_atomic, write_json_atomic
from qic.manifest import canonical, sha256_file

DONE = "done"
META = "meta.json"
SIGNATURE = "signature.json"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def entry_dir(cache_dir: Path, gkey: str) -> Path:
    return Path(cache_dir) / "graphs" / gkey


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
    d = entry_dir(cache_dir, gkey)
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


# ---- signatures ----------------------------------------------------------------------------------

def load_private_key(path: str | Path):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    try:
        key = load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}: not a readable PEM private key ({e})",
                          "make one with `qic cache keygen KEYFILE`") from None
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an Ed25519 key", "make one with `qic cache keygen KEYFILE`")
    return key


def public_key_hex(private_key) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def parse_public_keys(values) -> list[str]:
    """Public keys as hex: each value is 64 hex digits, or a file holding them (one per line)."""
    keys = []
    for v in values or ():
        v = str(v).strip()
        text = Path(v).read_text() if Path(v).is_file() else v
        for line in text.split():
            try:
                if len(bytes.fromhex(line)) != 32:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"public key {line[:20]!r} (from {v}) is not 64 hex digits (an Ed25519 key)",
                                  "pass the .pub file `qic cache keygen` wrote") from None
            keys.append(line.lower())
    return keys


def sign(meta: dict, private_key) -> dict:
    return {"algorithm": "ed25519", "public_key": public_key_hex(private_key),
            "signature": private_key.sign(canonical(meta)).hex()}


def signature_problem(d: Path, meta: dict, public_keys: list[str]) -> str | None:
    """None if the entry's signature over its meta verifies against one of `public_keys`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    try:
        sig = json.loads((d / SIGNATURE).read_text())
    except FileNotFoundError:
        return "it is not signed"
    except (OSError, ValueError):
        return "its signature file is unreadable"
    if not isinstance(sig, dict) or sig.get("public_key") not in public_keys:
        return "it is not signed by a configured public key"
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(sig["public_key"])).verify(
            bytes.fromhex(sig["signature"]), canonical(meta))
    except (InvalidSignature, ValueError, KeyError, TypeError):
        return "its signature does not verify"
    return None


def keygen(path: Path) -> tuple[Path, str]:
    """An Ed25519 key pair: PATH (private, PEM, mode 0600) and PATH.pub (the public key as hex)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path}: already exists; not overwriting a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = public_key_hex(key)
    Path(f"{path}.pub").write_text(pub + "\n")
    return Path(f"{path}.pub"), pub


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
    root = Path(cache_dir) / "graphs"
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
        with file_lock(Path(cache_dir) / "locks" / f"graph-{e.key}.lock"):
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
