"""Atomic file and directory writes, inter-process locks, and sweeping what killed writers left: a reader
never sees a partial file, a killed writer leaves only a leftover that a later sweep removes.

Leftovers (staging `.tmp-*` and replaced `.old-*` directories) carry their writer in their name,
`<kind>-<name>-<pid>@<host id>-<tag>`, where the host id names the host, its boot and the pid namespace
(`host_id`). A pid only names a process within that scope, and a cache may be shared over NFS or between
containers, so a sweep judges a leftover by its pid only when the leftover's host id is its own. Any other
leftover (another host's, boot's or container's, or one named before host ids existed) is removed only
once nothing in it has been written for `STALE_SECONDS`. This was chosen over a lease file (a writer would
need a thread refreshing it through hour-long compiles) and over flock (not honoured across hosts by every
NFS set-up): the name is created atomically with the directory and costs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

# How long another host's leftover must sit untouched before a sweep removes it: far longer than a live
# writer goes without writing (a compile or shard writes its output as it goes), and far beyond clock skew
# between NFS clients and server.
STALE_SECONDS = 24 * 3600

_OWNER = re.compile(r"(\d+)(?:@([0-9a-f]{12}))?")   # pid, then host id (absent in names from before it)


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


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's names (what was created or renamed in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_temp_dir(final: Path) -> Path:
    """A new `.tmp-<final>-<pid>@<host>-<random>` directory beside `final` (mkdtemp's random part has no '-')."""
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
        fsync_path(final.parent)   # the rename itself survives a crash
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(staged: Path, final: Path) -> None:
    """Swap a fully written directory into place; the old one (if any) is removed afterwards.

    Where the kernel can (Linux renameat2 RENAME_EXCHANGE: ext4, xfs, btrfs, tmpfs, overlayfs...), the two
    are exchanged in one step, so `final` names a complete directory at every moment. Where it cannot
    (e.g. NFS, other systems), the old one is renamed aside first: for a moment there is none at `final`,
    never a mixed one. A killed process leaves the old one under a leftover name, which a sweep removes.
    """
    final = Path(final)
    if not final.exists():
        os.rename(staged, final)
        return
    old = final.with_name(leftover_name(".old", final.name, "replaced"))
    if _exchange(staged, final):
        os.rename(staged, old)   # the old directory, now under the staged name: name it for what it is
    else:
        os.rename(final, old)
        os.rename(staged, final)
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2   # glibc 2.28+
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the system or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# ---- owners and sweeps --------------------------------------------------------------------------------

@functools.cache
def host_id() -> str:
    """12 hex digits naming this host, boot and pid namespace: the scope in which a pid names one process.
    Without /proc (not Linux) it is the host name alone."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def leftover_name(kind: str, name: str, tag: str) -> str:
    """`<kind>-<name>-<pid>@<host id>-<tag>` (kind .tmp or .old; tag without '-'): what sweep_stale parses."""
    return f"{kind}-{name}-{os.getpid()}@{host_id()}-{tag}"


def leftover_owner(filename: str, name: str | None = None) -> tuple[int, str | None] | None:
    """(pid, host id or None) of a leftover's name (of entry `name`, if given); None for anything else."""
    kind, _, rest = filename.partition("-")
    parts = rest.rsplit("-", 2)
    if kind not in (".tmp", ".old") or len(parts) != 3 or (name is not None and parts[0] != name):
        return None
    m = _OWNER.fullmatch(parts[1])
    return (int(m.group(1)), m.group(2)) if m else None


def abandoned(path: Path, owner: tuple[int, str | None], stale_seconds: float = STALE_SECONDS) -> bool:
    """Whether the writer of the leftover `path` is gone (see the module's docstring)."""
    pid, host = owner
    if host == host_id():
        return not _alive(pid)
    return idle_for(path, stale_seconds)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def idle_for(path: Path, seconds: float) -> bool:
    """True if nothing in `path` (itself, and everything under a directory) was modified for `seconds`."""
    cutoff = time.time() - seconds
    try:
        if os.lstat(path).st_mtime > cutoff:
            return False
    except FileNotFoundError:
        return True
    for root, dirs, files in os.walk(path):
        for n in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(os.path.join(root, n)).st_mtime > cutoff:
                    return False
    return True


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep_stale(directory: Path, name: str | None = None, stale_seconds: float = STALE_SECONDS) -> list[Path]:
    """Remove what killed writers left in `directory`: temp, damaged and replaced `.old` directories named
    by `leftover_name` (only those of entry `name`, if given) whose writer is gone (`abandoned`); returns
    them. Live writers' leftovers stay, and so do other hosts' until they have sat idle `stale_seconds`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for p in directory.iterdir():
        owner = leftover_owner(p.name, name)
        if owner is not None and abandoned(p, owner, stale_seconds):
            remove_path(p)
            removed.append(p)
    return removed


# ---- locks --------------------------------------------------------------------------------------------

class FileLock:
    """An advisory inter-process lock (flock on a lock file): exclusive for writers, `shared` for readers
    that only need an entry to stay while they use it. `qic cache prune` unlinks lock files it holds
    exclusively, so a lock taken on a file that was unlinked (or replaced) meanwhile is let go and taken
    again on the file now at the path: two holders never hold two different files."""

    def __init__(self, path: Path, shared: bool = False):
        self.path, self.shared, self.fd = Path(path), shared, None

    def acquire(self, blocking: bool = True) -> bool:
        op = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)   # flock needs no write access
            try:
                fcntl.flock(fd, op)
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self.fd = fd
                return True
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)   # closing drops the flock
            self.fd = None

    def unlink(self) -> None:
        """Remove the lock file; only while holding it exclusively."""
        assert self.fd is not None and not self.shared
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:   # at interpreter exit the fd is closed anyway
            pass


def file_lock(path: Path, shared: bool = False) -> FileLock:
    """`with file_lock(path):` holds the lock for the block (see FileLock)."""
    return FileLock(path, shared)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when possible (same file system, no extra space), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
