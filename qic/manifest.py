"""Bundle manifests: read, write, verify hashes, check compatibility. Stdlib only (plus torch's version).

A bundle is trusted for matching, never for existing: every file it names carries a sha256, the
manifest itself carries a content hash (the bundle id), and the runtime checks all of it before any
compiled code is loaded (weight files by a remembered hash while their identity is unchanged, see
qic/verified.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from qic.errors import BundleError

# Raise FORMAT_VERSION whenever a manifest gains a field that an older runtime would misread or silently ignore
# (format 2: `layout`; a runtime before it would run a world-4 bundle on world 2. Format 3: `family`, the model
# family and its host program; a runtime before it would run any family's bundle as Qwen-Image's text-to-image).
# A qic older than the bundle then refuses it with "upgrade qic" (read_manifest below, checked before any graph or
# weight is touched); one newer than the bundle refuses it with "rebuild". A field an older runtime may safely
# ignore needs no bump. Format 4: `kind` (a weight set, qic build --weights-for, which a runtime before it would take
# for a bundle and fail on) and `layers` (how a weight set for a bundle's graphs is cut). The build key includes the
# format, so a bundle of an older format is written again by a build to the same output.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
# A manifest's `kind` when it describes a weight set (qic build --weights-for): weight files cut for another bundle's
# graphs and no graphs of its own; a bundle's manifest has no `kind`.
WEIGHT_SET = "weights"


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def bundle_id(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "id"}
    return hashlib.sha256(canonical(body)).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, rel: str) -> dict:
    p = Path(root) / rel
    return {"sha256": sha256_file(p), "bytes": p.stat().st_size}


def read_manifest(bundle: Path) -> dict:
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: no such bundle directory", "build one with `qic build`")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{bundle}: not a qic bundle (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BundleError(f"{path}: corrupt manifest (not JSON)") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: corrupt manifest (a JSON {type(manifest).__name__}, not an object)")
    fmt = manifest.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT_VERSION:
        # Made by a newer qic: rebuilding with this one would work but loses what the newer one does.
        raise BundleError(f"{path}: bundle format {fmt} is newer than this qic reads ({FORMAT_VERSION})",
                          "upgrade qic (pip install -U qic) to run it")
    if fmt != FORMAT_VERSION:
        raise BundleError(f"{path}: bundle format {fmt!r} is not {FORMAT_VERSION}",
                          "rebuild the bundle with this qic")
    if manifest.get("id") != bundle_id(manifest):
        raise BundleError(f"{path}: manifest content hash mismatch (the manifest was edited or damaged)")
    return manifest


def read_bundle(bundle: Path) -> dict:
    """read_manifest, refusing a weight set (it has no graphs to run) in one line."""
    manifest = read_manifest(bundle)
    if manifest.get("kind") == WEIGHT_SET:
        raise BundleError(f"{bundle}: a weight set (qic build --weights-for), not a bundle: it has no graphs",
                          f"run it through the bundle it was cut for: --weights {bundle}")
    return manifest


def weight_files(manifest: dict) -> set[str]:
    """The bundle's weight shards: the only files whose verification may be remembered between loads."""
    return {rel for g in manifest.get("graphs", []) for rel in g["weights"]}


def verify_files(bundle: Path, manifest: dict, progress=None, cache=None, full: bool = False) -> int:
    """Check every file the manifest names; refuse on any mismatch, missing or extra file.

    Compiled code, constants and tokenizer files are hashed every time. A weight file is skipped only
    when `cache` (a qic.verified.VerificationCache) holds a record of it hashing to its manifest sha256
    with the identity it has now; `full` hashes all of them regardless. Files hashed here are recorded.
    Returns how many weight files were trusted from records.
    """
    bundle = Path(bundle)
    files = manifest.get("files", {})
    weights = weight_files(manifest)
    trusted = 0
    for rel, entry in files.items():
        p = bundle / rel
        if not p.is_file():
            raise BundleError(f"{bundle}: missing file {rel}")
        st = p.stat()
        remember = cache is not None and rel in weights
        recorded = remember and not full and cache.has(manifest["id"], rel, entry["sha256"], st)
        if st.st_size == entry["bytes"] and recorded:
            trusted += 1
        else:
            began = time.time_ns()
            if st.st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
                raise BundleError(f"{bundle}: {rel} does not match its sha256 in the manifest (tampered or damaged)",
                                  "rebuild the bundle")
            if remember:
                cache.record(manifest["id"], rel, entry["sha256"], p, st, began)
        if progress:
            progress(rel)
    for p in bundle.rglob("*"):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and rel != MANIFEST and rel not in files:
            raise BundleError(f"{bundle}: unlisted file {rel} in the bundle")
    return trusted


def check_compatible(manifest: dict, qic_version: str, torch_version: str) -> None:
    built = manifest.get("versions", {})
    if built.get("torch") != torch_version:
        raise BundleError(f"bundle was built with torch {built.get('torch')}, this is torch {torch_version}",
                          "rebuild the bundle with this torch")
    if _major_minor(built.get("qic", "")) != _major_minor(qic_version):
        raise BundleError(f"bundle was built with qic {built.get('qic')}, this is qic {qic_version}",
                          "rebuild the bundle with this qic")


def _major_minor(v: str) -> tuple:
    return tuple(v.split(".")[:2])


def finalize(manifest: dict) -> dict:
    manifest = {**manifest, "format": FORMAT_VERSION}
    manifest["id"] = bundle_id(manifest)
    return manifest
