"""qic/cache/store.py and friends on hand-made entries (nothing compiles): adoption verifies what it
publishes, sealing flushes before `done`, prune covers every kind and spares what builds hold, and the
small files (public keys, warm reports) are written atomically."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from qic.cache import layout, signing, store
from qic.cache.remote import DirectoryRemote
from qic.cli import main as cli
from qic.errors import ConfigError
from qic.fsutil import host_id, staging_dir
from qic.manifest import sha256_file

IDENTITY = {"backend": "fake", "torch": "0"}
DAY = 86400


def _entry(cache: Path, gkey: str, data: bytes = b"compiled code", key=None, last_used: float | None = None) -> Path:
    """A sealed graph entry holding one artifact file, signed by `key` when given."""
    with staging_dir(layout.graph_dir(cache, gkey)) as tmp:
        (tmp / "graph.pt2").write_bytes(data)
        store.seal(tmp, _meta(tmp, gkey), key)
    d = layout.graph_dir(cache, gkey)
    if last_used is not None:
        os.utime(d / store.DONE, (last_used, last_used))
    return d


def _meta(d: Path, gkey: str) -> dict:
    return {"graph": f"g-{gkey[:4]}", "key": gkey, "backend": IDENTITY,
            "files": {"graph.pt2": {"sha256": sha256_file(d / "graph.pt2"), "bytes": (d / "graph.pt2").stat().st_size}}}


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t))


@pytest.fixture(scope="module")
def key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    return Ed25519PrivateKey.generate()


# ---- adoption --------------------------------------------------------------------------------------

def test_adopted_entry_is_verified_and_records_its_origin(tmp_path, key):
    remote = tmp_path / "remote"
    _entry(remote, "a" * 32, key=key)
    local = tmp_path / "local"
    meta = DirectoryRemote(remote, [signing.public_key_hex(key)], False).fetch("a" * 32, local, IDENTITY)
    assert meta["key"] == "a" * 32
    d = layout.graph_dir(local, "a" * 32)
    assert json.loads((d / store.ORIGIN).read_text())["adopted_from"] == str(remote)
    assert store.check_entry(d, IDENTITY) == (None, meta)                 # origin.json is no damage
    assert signing.signature_problem(d, meta, [signing.public_key_hex(key)]) is None   # and the signature holds


def test_a_remote_that_swaps_its_files_after_the_signature_check_is_refused(tmp_path, key, monkeypatch, capsys):
    """The remote replaces graph.pt2 and meta.json (with matching hashes) once the check has passed, i.e.
    while the files are copied. Checking the remote then copying publishes the swapped files (the local
    re-check saw consistent hashes); checking the local copy refuses them."""
    gkey = "b" * 32
    src = _entry(tmp_path / "remote", gkey, key=key)
    real_copy = shutil.copyfile
    swapped = []

    def swap_then_copy(a, b, **kw):
        if not swapped:
            swapped.append(True)
            (src / "graph.pt2").write_bytes(b"evil code")
            store.write_json_atomic(src / store.META, _meta(src, gkey))
        return real_copy(a, b, **kw)
    monkeypatch.setattr(shutil, "copyfile", swap_then_copy)
    local = tmp_path / "local"
    got = DirectoryRemote(tmp_path / "remote", [signing.public_key_hex(key)], False).fetch(gkey, local, IDENTITY)
    assert swapped and got is None
    assert f"remote entry {gkey} refused: its signature does not verify" in capsys.readouterr().err
    assert not layout.graph_dir(local, gkey).exists()
    assert not [p for p in layout.graphs_dir(local).iterdir()]            # no staging left either


# ---- sealing ---------------------------------------------------------------------------------------

def test_seal_flushes_every_file_and_the_directory_before_done(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", record)
    with staging_dir(tmp_path / "graphs" / ("c" * 32)) as tmp:
        (tmp / "graph.pt2").write_bytes(b"code")
        store.seal(tmp, _meta(tmp, "c" * 32))
        done = next(i for i, p in enumerate(synced) if Path(p).name.startswith(".done."))
        assert str(tmp / "graph.pt2") in synced[:done]
        assert str(tmp) in synced[:done]                                  # the names, not just the data
        assert str(tmp) in synced[done:]                                  # and done's own name


# ---- shards ----------------------------------------------------------------------------------------

def test_a_shard_entry_without_meta_json_is_set_aside_and_rebuilt(tmp_path):
    from qic.builder.shard import _intact
    final = layout.shard_dir(tmp_path, "vae_decoder", "0123abcd")
    final.mkdir(parents=True)
    (final / "rank0.safetensors").write_bytes(b"half written")           # killed before meta.json
    assert _intact(final, 1) is None
    assert not final.exists()                                             # else the rebuild can never land
    with staging_dir(final) as tmp:
        (tmp / "rank0.safetensors").write_bytes(b"rebuilt")
    assert (final / "rank0.safetensors").read_bytes() == b"rebuilt"
    assert [p.name for p in final.parent.iterdir() if "damaged" in p.name]


# ---- prune -----------------------------------------------------------------------------------------

def _cache_of_every_kind(cache: Path):
    """Old and recent entries of every kind, their memos, plans and locks, and leftovers."""
    now = time.time()
    old_g = _entry(cache, "0" * 32, last_used=now - 10 * DAY)
    new_g = _entry(cache, "1" * 32, last_used=now)
    for skey, gkey in (("s-old", "0" * 32), ("s-new", "1" * 32), ("s-dangling", "9" * 32)):
        layout.write_memo(cache, skey, gkey)
        store.write_json_atomic(layout.plan_file(cache, skey), {"estimate": [1, 2, 3]})
    for gkey in ("0" * 32, "1" * 32, "8" * 32):                          # 8...: an orphan lock
        with layout.graph_lock(cache, gkey):
            pass
    shards = {}
    for name, age in (("old", 10 * DAY), ("new", 0)):
        d = layout.shard_dir(cache, "vae_decoder", f"{name}key")
        d.mkdir(parents=True)
        (d / "rank0.safetensors").write_bytes(b"w" * 100)
        store.write_json_atomic(d / "meta.json", {"component": "vae_decoder", "files": {}})
        _age(d, age)
        shards[name] = d
    neffs = {}
    for name, age in (("old", 10 * DAY), ("new", 0)):
        d = layout.neff_dir(cache, f"neff{name}")
        d.mkdir(parents=True)
        (d / "model.neff").write_bytes(b"n" * 50)
        _age(d, age)
        neffs[name] = d
    dead = layout.graphs_dir(cache) / f".tmp-pull-{'2' * 32}-999999999@{host_id()}-abc"   # a killed pull
    dead.mkdir()
    (dead / "graph.pt2").write_bytes(b"partial")
    live = layout.graphs_dir(cache) / f".tmp-{'3' * 32}-{os.getpid()}@{host_id()}-xyz"   # a live build's staging
    live.mkdir()
    return old_g, new_g, shards, neffs, dead, live


def test_prune_older_than_covers_every_kind(tmp_path):
    cache = tmp_path / "cache"
    old_g, new_g, shards, neffs, dead, live = _cache_of_every_kind(cache)
    removed = store.prune(cache, older_than=7 * DAY)
    kinds = sorted((e.kind, e.key) for e in removed)
    assert kinds == sorted([
        (store.LEFTOVER, dead.name),
        (layout.GRAPHS, "0" * 32), (layout.SHARDS, "vae_decoder-oldkey"), (layout.NEFFS, "neffold"),
        (layout.INDEX, "s-old"), (layout.INDEX, "s-dangling"),            # memos of entries that are gone
        (layout.PLAN, "s-old"), (layout.PLAN, "s-dangling"),              # and their plans
        (layout.LOCKS, "graph-" + "8" * 32),                               # an orphan lock nobody holds
    ])
    assert not old_g.exists() and not shards["old"].exists() and not neffs["old"].exists() and not dead.exists()
    assert new_g.exists() and shards["new"].exists() and neffs["new"].exists() and live.exists()
    assert layout.read_memo(cache, "s-new") == "1" * 32 and layout.plan_file(cache, "s-new").is_file()
    assert sorted(p.name for p in (cache / layout.LOCKS).iterdir()) == [f"graph-{'1' * 32}.lock"]
    assert not [p for p in (cache / layout.SHARDS).iterdir() if p.name.startswith(".")]


def test_prune_max_size_removes_least_recently_used_first(tmp_path):
    cache = tmp_path / "cache"
    now = time.time()
    for i, used in enumerate((now - 30, now - 10, now - 20)):
        _entry(cache, str(i) * 32, data=b"x" * 1000, last_used=used)
    size = sum(e.bytes for e in store.cache_entries(cache) if e.key == "1" * 32)
    removed = store.prune(cache, max_bytes=size)
    assert [e.key for e in removed if e.kind == layout.GRAPHS] == ["0" * 32, "2" * 32]
    assert [p.name for p in layout.graphs_dir(cache).iterdir()] == ["1" * 32]


def test_prune_skips_what_a_live_build_holds(tmp_path):
    cache = tmp_path / "cache"
    _, _, shards, neffs, _, _ = _cache_of_every_kind(cache)
    with layout.graph_users(cache, "0" * 32), layout.shard_lock(cache, "oldkey"), layout.neff_lock(cache, "neffold"):
        removed = store.prune(cache, max_bytes=0)
        assert layout.graph_dir(cache, "0" * 32).exists() and shards["old"].exists() and neffs["old"].exists()
        assert layout.read_memo(cache, "s-old") == "0" * 32               # its memo stays with it
    assert "1" * 32 in [e.key for e in removed]                          # the unheld ones went, even if recent
    assert {e.key for e in store.prune(cache, max_bytes=0)} >= {"0" * 32, "vae_decoder-oldkey", "neffold"}


def test_a_memo_hit_holds_its_entry_until_the_artifact_is_dropped(tmp_path):
    """The bundle step copies an artifact's files after compile_graph returns: prune must not remove them."""
    from qic.builder.compile import compile_graph

    class Backend:
        def identity(self):
            return IDENTITY
    cache = tmp_path / "cache"
    d = _entry(cache, "4" * 32)
    layout.write_memo(cache, "skey", "4" * 32)
    art = compile_graph(lambda: pytest.fail("a memo hit traces nothing"), Backend(), set(), cache, "skey")
    assert art.cached and art.directory == d
    assert not [e for e in store.prune(cache, max_bytes=0) if e.kind == layout.GRAPHS] and d.exists()
    del art
    assert [e.key for e in store.prune(cache, max_bytes=0) if e.kind == layout.GRAPHS] == ["4" * 32]


def test_cache_ls_lists_every_kind_and_prune_needs_a_criterion(tmp_path):
    cache = tmp_path / "cache"
    _cache_of_every_kind(cache)
    ls = CliRunner().invoke(cli, ["cache", "ls", str(cache)])
    assert ls.exit_code == 0, ls.output
    for kind in ("graphs", "shards", "neffs", "index", "plan", "locks", "leftover"):
        assert f"{kind}: " in ls.output
    none = CliRunner().invoke(cli, ["cache", "prune", str(cache)])
    assert none.exit_code == 2 and "needs --max-size or --older-than" in none.output
    bad = CliRunner().invoke(cli, ["cache", "prune", str(cache), "--older-than", "soon"])
    assert bad.exit_code == 2 and "is not a duration" in bad.output
    ok = CliRunner().invoke(cli, ["cache", "prune", str(cache), "--older-than", "7d"])
    assert ok.exit_code == 0 and f"removed {'0' * 32} graphs" in ok.output


def test_parse_duration():
    assert store.parse_duration("7d") == 7 * DAY and store.parse_duration("12h") == 12 * 3600
    assert store.parse_duration("1.5m") == 90 and store.parse_duration("2w") == 14 * DAY
    with pytest.raises(ConfigError):
        store.parse_duration("7")


# ---- small files written atomically -------------------------------------------------------------------

def _crash_at_publish(monkeypatch):
    """A crash just before the temp file would be renamed into place."""
    def crash(*a, **k):
        raise OSError("killed")
    monkeypatch.setattr(os, "replace", crash)


def test_keygen_never_leaves_a_truncated_public_key(tmp_path, monkeypatch):
    _crash_at_publish(monkeypatch)
    with pytest.raises(OSError):
        signing.keygen(tmp_path / "k.pem")
    assert not (tmp_path / "k.pem.pub").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pem"]       # no temp file either


def test_warm_report_is_replaced_atomically(tmp_path, monkeypatch):
    from qic.builder.warm import WarmRow, write_report
    report = tmp_path / "warm.json"
    rows = [WarmRow("j1", "vae_decoder@48x80", "embedded:tiny", "compiled", 1.0, 10)]
    write_report(report, 1, rows, None)
    before = report.read_text()
    assert json.loads(before)["summary"]["compiled"] == 1
    _crash_at_publish(monkeypatch)
    with pytest.raises(OSError):
        write_report(report, 2, rows * 2, "1/2")
    assert report.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["warm.json"]
