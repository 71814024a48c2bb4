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


def make_temp_dir(final: Path) -> Path:
    """A new `.tmp-<final>-<pid>-<random>` directory beside `final` (mkdtemp's random part has no '-')."""
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=leftover_name(".tmp", final.name, "")))
    public_mode(tmp, directory=True)
    return tmp


@contextlib.contextmanager
def staging_dir(final: Path):
    """Yield a temp directory beside `final`; on success it is renamed into place atomically.

    If `final` appeared meanwhile (a concurrent writer finished first), ours is discarded: entries are
    content-addressed, so both are the same. A killed writer leaves only a `.tmp-*` directory, which is
    never read and is swept by `sweep_stale`.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(final)
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
        old = final.with_name(leftover_name(".old", final.name, "replaced"))
        os.rename(final, old)
    os.rename(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def leftover_name(kind: str, name: str, tag: str) -> str:
    """`<kind>-<name>-<pid>-<tag>` (kind .tmp or .old; tag without '-'): what sweep_stale parses."""
    return f"{kind}-{name}-{os.getpid()}-{tag}"


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


def sweep_stale(directory: Path, name: str | None = None) -> None:
    """Remove what killed writers left in `directory`: temp, damaged and replaced `.old` directories
    named by `leftover_name` (only those of entry `name`, if given). Live processes' leftovers stay."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        kind, _, rest = p.name.partition("-")
        try:
            entry, pid, _tag = rest.rsplit("-", 2)
            if kind not in (".tmp", ".old") or (name is not None and entry != name):
                continue
            os.kill(int(pid), 0)
        except ValueError:
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
