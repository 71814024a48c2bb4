"""qic/fsutil.py: the inter-process lock really excludes, leftovers of dead writers are swept (only this host's
by pid), a replaced directory is never missing, and an atomic write that fails (disk full) leaves nothing."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from qic import fsutil
from qic.fsutil import FileLock, file_lock, host_id, leftover_name, replace_dir, sweep_stale
from tests.conftest import ROOT

_TAKE_LOCK = """
import sys, time
from qic.fsutil import file_lock
print("waiting", flush=True)
with file_lock(sys.argv[1]):
    print(time.time(), flush=True)
"""


def test_file_lock_excludes_another_process(tmp_path):
    lock = tmp_path / "locks" / "x.lock"
    with file_lock(lock):
        child = subprocess.Popen([sys.executable, "-c", _TAKE_LOCK, str(lock)], cwd=ROOT, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout.readline() == "waiting\n"
        time.sleep(0.5)   # the child is at the lock now; a lock that did not exclude would let it through
        released = time.time()
    acquired = float(child.stdout.readline())
    assert child.wait(timeout=30) == 0
    assert acquired >= released


_DAMAGE = """
import sys
from pathlib import Path
from qic.builder.shard import _intact
assert _intact(Path(sys.argv[1]), 1) is None
"""


def test_damaged_cache_entries_are_swept_once_their_process_is_gone(tmp_path):
    shards = tmp_path / "shards"
    entry = shards / "vae_decoder-0123abcd"
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text("{}")   # no file stamps: the cache treats it as damaged
    # The shard stage moves a damaged entry aside (in another process, which then exits).
    subprocess.run([sys.executable, "-c", _DAMAGE, str(entry)], cwd=ROOT, check=True)
    moved = list(shards.iterdir())
    assert len(moved) == 1 and "damaged" in moved[0].name
    sweep_stale(shards)
    assert not list(shards.iterdir())


def test_sweep_keeps_live_writers_and_other_entries(tmp_path):
    live = tmp_path / leftover_name(".tmp", "bundle", "x1")     # ours: this process is alive
    dead = tmp_path / f".tmp-bundle-999999999@{host_id()}-x2"   # this host and boot, no such pid
    other = tmp_path / f".tmp-other-999999999@{host_id()}-x3"
    plain = tmp_path / "bundle"
    for p in (live, dead, other, plain):
        p.mkdir()
    sweep_stale(tmp_path, "bundle")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, plain.name])
    sweep_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, plain.name])


def _age(path, seconds):
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def test_sweep_judges_only_this_hosts_leftovers_by_pid(tmp_path, monkeypatch):
    """On a cache shared over NFS or between containers, a pid from another host means nothing here."""
    here = host_id()
    monkeypatch.setattr(fsutil, "host_id", lambda: "0123456789ab")    # a writer on another host
    monkeypatch.setattr(fsutil.os, "getpid", lambda: 999999999)       # whose pid is no process here
    foreign = tmp_path / leftover_name(".tmp", "bundle", "live")
    foreign_stale = tmp_path / leftover_name(".tmp", "bundle", "stale")
    foreign_busy = tmp_path / leftover_name(".tmp", "bundle", "busy")
    monkeypatch.undo()
    assert host_id() == here and here not in foreign.name
    ours_dead = tmp_path / f".tmp-bundle-999999999@{here}-dead"
    legacy = tmp_path / ".tmp-bundle-999999999-old"                   # named before host ids: owner unknown
    for p in (foreign, foreign_stale, foreign_busy, ours_dead, legacy):
        (p / "sub").mkdir(parents=True)
        (p / "sub" / "f").write_bytes(b"x")
    _age(foreign_stale, fsutil.STALE_SECONDS + 3600)
    _age(foreign_busy, fsutil.STALE_SECONDS + 3600)
    (foreign_busy / "sub" / "f").write_bytes(b"still writing")        # an old dir, a file written just now
    removed = sweep_stale(tmp_path, "bundle")
    assert sorted(p.name for p in removed) == sorted([ours_dead.name, foreign_stale.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.name, foreign_busy.name, legacy.name])


def _manifest(d, text):
    d.mkdir()
    (d / "manifest.json").write_text(text)


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_in_the_new_directory(tmp_path, monkeypatch, exchange):
    final, staged = tmp_path / "bundle", tmp_path / leftover_name(".tmp", "bundle", "new")
    _manifest(final, "old")
    _manifest(staged, "new")
    if not exchange:   # a file system without RENAME_EXCHANGE (e.g. NFS): rename aside, then into place
        monkeypatch.setattr(fsutil, "_exchange", lambda a, b: False)
    replace_dir(staged, final)
    assert (final / "manifest.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]        # neither the staged nor the old one left


def test_replace_dir_never_leaves_the_output_without_a_bundle(tmp_path, monkeypatch):
    if fsutil._renameat2() is None:
        pytest.skip("renameat2 is Linux (glibc 2.28+) only")
    final, staged = tmp_path / "bundle", tmp_path / leftover_name(".tmp", "bundle", "new")
    _manifest(final, "old")
    _manifest(staged, "new")
    seen = []

    def check(real):
        def wrapped(*args, **kw):
            seen.append((final / "manifest.json").is_file())          # a reader looking right now
            return real(*args, **kw)
        return wrapped
    monkeypatch.setattr(fsutil.os, "rename", check(os.rename))
    monkeypatch.setattr(fsutil.os, "replace", check(os.replace))
    monkeypatch.setattr(fsutil.shutil, "rmtree", check(shutil.rmtree))
    replace_dir(staged, final)
    assert seen and all(seen)
    assert (final / "manifest.json").read_text() == "new"


def test_a_lock_file_unlinked_by_its_holder_is_not_held_twice(tmp_path):
    """prune unlinks a lock file while holding it; a waiter that opened the old file must not then hold
    that (unlinked) file while another process holds the new one at the same path."""
    path = tmp_path / "x.lock"
    first = FileLock(path)
    assert first.acquire()
    got = threading.Event()
    waiter = FileLock(path)
    t = threading.Thread(target=lambda: (waiter.acquire(), got.set()))
    t.start()
    time.sleep(0.3)                      # the waiter has the old file open and waits on it
    first.unlink()
    newer = FileLock(path)
    assert newer.acquire(blocking=False)
    first.release()
    assert not got.wait(0.5)             # woke on the unlinked file, saw it unlinked, now waits on the new one
    newer.release()
    assert got.wait(10)
    t.join()
    assert os.path.samestat(os.fstat(waiter.fd), os.stat(path))
    assert not FileLock(path, shared=True).acquire(blocking=False)
    waiter.release()
    assert FileLock(path, shared=True).acquire(blocking=False)


def test_disk_full_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
    from qic import fsutil

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(fsutil.os, "fsync", full)
    with pytest.raises(OSError):
        fsutil.write_bytes_atomic(tmp_path / "out.png", b"x" * 1000)
    assert list(tmp_path.iterdir()) == []
