"""qic/fsutil.py: the inter-process lock really excludes, and leftovers of dead writers are swept."""

from __future__ import annotations

import subprocess
import sys
import time

from qic.fsutil import file_lock, leftover_name, sweep_stale
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
    dead = tmp_path / ".tmp-bundle-999999999-x2"                # no such pid
    other = tmp_path / ".tmp-other-999999999-x3"
    plain = tmp_path / "bundle"
    for p in (live, dead, other, plain):
        p.mkdir()
    sweep_stale(tmp_path, "bundle")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, plain.name])
    sweep_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, plain.name])
