"""Atomic file and directory writes: a reader never sees a partial file, a killed writer leaves none."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_mode(path: Path, directory: bool = False) -> None:
    """Temp files and dirs are created private (0600/0700); give finished ones the usual umask mode."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        public_mode(Path(tmp))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def staging_dir(final: Path):
    """Yield a temp directory beside `final`; on success it is renamed into place atomically.

    If `final` appeared meanwhile (a concurrent writer finished first), ours is discarded: entries are
    content-addressed, so both are the same. A killed writer leaves only a `.tmp-*` directory, which is
    never read and is swept by `sweep_stale`.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-{os.getpid()}-"))
    public_mode(tmp, directory=True)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(staged: Path, final: Path) -> None:
    """Swap a fully written directory into place; the old one (if any) is removed afterwards."""
    final = Path(final)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path):
    """An advisory inter-process lock, so concurrent builds do not do the same work twice."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sweep_stale(directory: Path) -> None:
    """Remove temp directories left by killed writers (their pid is gone); live writers' stay."""
    for p in Path(directory).glob(".tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            continue


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when possible (same file system, no extra space), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
