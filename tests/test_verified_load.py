"""Issue 11: verified loading that scales — weight files hashed once, then trusted while unchanged (another
bundle's, given as --weights, too).

The big bundle is the session's tiny bundle with a 1 GiB tensor appended to its denoiser shard. The
tensor is a hole in a sparse file (no disk, no write time), but hashing it still reads 1 GiB through
read(), which is what the I/O counters measure, as they would for a real 58 GB checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import time

import psutil
import pytest
from click.testing import CliRunner

from qic.cli import main
from qic.cli.inspect import run_inspect
from qic.errors import BundleError
from qic.manifest import MANIFEST, file_entry, finalize
from qic.runtime.bundle import Bundle
from qic.verified import RACY_NS, VerificationCache
from tests.conftest import qic

GIB = 1 << 30
PAD = "qic_test_padding"


def _read_chars() -> int:
    return psutil.Process().io_counters().read_chars


def _load(path, **kw) -> tuple[Bundle, int]:
    before = _read_chars()
    b = Bundle(path, **kw)
    return b, _read_chars() - before


def _append_sparse_tensor(path, nbytes: int) -> None:
    """Rewrite a safetensors file with one more U8 tensor of `nbytes` zeros, left as a hole."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header[PAD] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [len(data), len(data) + nbytes]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.unlink()  # the session bundle's shard is a hard link into its cache: never write through it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)
        f.truncate(8 + len(head) + len(data) + nbytes)


def _wait_until_not_racy(path) -> None:
    """A file changed in the last RACY_NS is hashed but not recorded (qic/verified.py); let it age."""
    age = time.time_ns() - path.stat().st_ctime_ns
    if age < RACY_NS:
        time.sleep((RACY_NS - age) / 1e9 + 0.05)


@pytest.fixture(scope="module")
def _big(bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("verified-load") / "big"
    shutil.copytree(bundle, out)
    m = json.loads((out / MANIFEST).read_text())
    rel = next(g for g in m["graphs"] if g["component"] == "denoiser")["weights"][0]
    _append_sparse_tensor(out / rel, GIB)
    m["files"][rel] = file_entry(out, rel)
    m = finalize({k: v for k, v in m.items() if k != "id"})
    (out / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True))
    return out, out / rel


@pytest.fixture
def big_bundle(_big, tmp_path, monkeypatch):
    """(bundle dir, its 1 GiB weight file), with this test's own, empty verification records."""
    monkeypatch.setenv("QIC_VERIFY_CACHE", str(tmp_path / "verified"))
    _wait_until_not_racy(_big[1])
    return _big


def test_second_load_reads_no_weight_bytes_and_is_fast(big_bundle):
    path, weight = big_bundle
    assert weight.stat().st_size > GIB
    first, read1 = _load(path)
    assert read1 > GIB, "the first load must hash the weight file"
    second, read2 = _load(path)
    print(f"first load {first.load_seconds:.2f}s reading {read1 / 1e6:.0f} MB; "
          f"second {second.load_seconds:.3f}s reading {read2 / 1e6:.1f} MB")
    # What remains is the manifest, tokenizer and compiled graphs (a few MB for the tiny model).
    assert read2 < 64e6 and second.trusted_weight_files == len({r for g in first.manifest["graphs"]
                                                                 for r in g["weights"]})
    assert second.load_seconds < 0.5
    # The CLI's reported load time says the same.
    proc = qic("run", path, "--prompt", "a cat", "--steps", "2", "--output", path.parent / "x.png", "--verbose")
    load = float(proc.stdout.split("load ")[1].split("s")[0])
    assert load < 0.5, proc.stdout


def test_a_weight_file_altered_in_place_is_rehashed_and_refused(big_bundle):
    path, weight = big_bundle
    _load(path)
    st = weight.stat()
    _flip_byte(weight, 100)   # same size, then the old mtime put back: only the ctime tells
    try:
        os.utime(weight, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert weight.stat().st_size == st.st_size and weight.stat().st_mtime_ns == st.st_mtime_ns
        before = _read_chars()
        with pytest.raises(BundleError, match="does not match its sha256"):
            Bundle(path)
        assert _read_chars() - before > GIB  # hashed again, not trusted
    finally:
        _flip_byte(weight, 100)  # the module's other tests share this bundle


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_flags_rehash_even_a_file_the_records_vouch_for(bundle, tmp_path, monkeypatch, capsys):
    """--verify-all and --verify ignore the records: shown with a record forged for a tampered file."""
    monkeypatch.setenv("QIC_VERIFY_CACHE", str(tmp_path / "verified"))
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    m = json.loads((b / MANIFEST).read_text())
    rel = m["graphs"][0]["weights"][0]
    data = bytearray((b / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (b / rel).unlink()
    (b / rel).write_bytes(bytes(data))
    cache = VerificationCache()
    cache.directory.mkdir(parents=True)
    cache._path(m["id"], rel, m["files"][rel]["sha256"], (b / rel).stat()).write_text("{}")  # the forgery
    run_inspect(str(b))   # trusted, as a record is meant to be
    out = " ".join(capsys.readouterr().out.split())
    assert "all hashes match (1 unchanged weight file(s) by their recorded hash" in out, out
    with pytest.raises(BundleError, match="does not match its sha256"):
        run_inspect(str(b), full=True)
    with pytest.raises(BundleError, match="does not match its sha256"):
        Bundle(b, verify_all=True)
    # The flags reach those: `qic run --verify-all` and `qic inspect --verify` refuse it too.
    for args in (["inspect", str(b), "--verify"], ["run", str(b), "--prompt", "x", "--verify-all"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "does not match its sha256" in result.output, result.output
    assert CliRunner().invoke(main, ["inspect", str(b)]).exit_code == 0


def test_read_only_bundle_loads_and_is_not_written(big_bundle):
    path, _ = big_bundle
    _load(path)
    mode = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
    for p in mode:
        p.chmod(stat.S_IMODE(mode[p]) & ~0o222)
    try:
        # chmod does not stop root, so also show that nothing was written: any write changes a ctime.
        before = {p: p.stat().st_ctime_ns for p in mode}
        assert Bundle(path).graphs
        assert {p: p.stat().st_ctime_ns for p in [path, *path.rglob("*")]} == before
    finally:
        for p, m in mode.items():
            p.chmod(stat.S_IMODE(m))


def test_unwritable_records_only_cost_a_rehash(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("QIC_VERIFY_CACHE", str(tmp_path / "not-a-dir"))
    (tmp_path / "not-a-dir").write_text("a file where the cache directory should be")
    assert Bundle(bundle).trusted_weight_files == 0
    assert Bundle(bundle).trusted_weight_files == 0


def test_a_file_changed_just_before_hashing_is_not_recorded(tmp_path):
    cache = VerificationCache(tmp_path / "verified")
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 10)
    st = f.stat()
    cache.record("id", "w", "sha", f, st, time.time_ns())
    assert not cache.has("id", "w", "sha", st)
    cache.record("id", "w", "sha", f, st, st.st_ctime_ns + RACY_NS + 1)
    assert cache.has("id", "w", "sha", st)
    f.write_bytes(b"y" * 10)   # same size: the identity's ctime (and mtime) differ
    assert not cache.has("id", "w", "sha", f.stat())


def test_records_that_can_no_longer_match_are_swept(tmp_path):
    """Each edit or rebuild writes new records; the old ones, whose file changed or is gone, are swept
    when the next record is written, and a record that still matches its file is kept."""
    cache = VerificationCache(tmp_path / "verified")
    kept, edited, gone = (tmp_path / f"{n}.safetensors" for n in ("kept", "edited", "gone"))
    for f in (kept, edited, gone):
        f.write_bytes(b"x" * 10)
    began = time.time_ns() + 2 * RACY_NS   # hashing "began" well after the writes: not racy
    for f in (kept, edited, gone):
        cache.record("id", f.name, "sha", f, f.stat(), began)
    (cache.directory / ".x.tmp").write_text("a concurrent writer's temp file")
    assert len(list(cache.directory.iterdir())) == 4
    edited.write_bytes(b"y" * 10)
    gone.unlink()
    assert cache.sweep() == 2
    assert cache.has("id", kept.name, "sha", kept.stat())
    assert sorted(p.name for p in cache.directory.iterdir() if len(p.name) != 64) == [".x.tmp"]
    assert len([p for p in cache.directory.iterdir() if len(p.name) == 64]) == 1
    # Writing a record sweeps once per cache object (one load), without being asked.
    cache2 = VerificationCache(tmp_path / "verified")
    edited_st = edited.stat()
    kept.write_bytes(b"z" * 10)
    cache2.record("id", edited.name, "sha2", edited, edited_st, time.time_ns() + 2 * RACY_NS)
    assert cache2.has("id", edited.name, "sha2", edited_st)
    assert len([p for p in cache.directory.iterdir() if len(p.name) == 64]) == 1


# ---- issue 19's finding 8: --weights uses the verification records ---------------------------------------

def test_weights_from_another_bundle_are_not_rehashed_on_every_load(bundle, bundle_two_res, monkeypatch):
    from qic import manifest as manifest_module
    from qic.runtime.bundle import Bundle
    other = bundle_two_res[0]
    # A file changed less than RACY_NS before its hash is hashed but never recorded (qic/verified.py): wait that
    # out, since an export build (seconds) may have written the other's weights just now, e.g. when this test
    # is the first to ask for bundle_two_res
    newest = max(f.stat().st_ctime_ns for f in (other / "weights").rglob("*") if f.is_file())
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9) + 0.1)
    Bundle(bundle, weights_from=other)   # the first load hashes (and records) the other's weights
    hashed = []
    real = manifest_module.sha256_file
    monkeypatch.setattr(manifest_module, "sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    Bundle(bundle, weights_from=other)
    assert not [p for p in hashed if str(p).startswith(str(other)) and "/weights/" in str(p)], hashed
    hashed.clear()
    Bundle(bundle, weights_from=other, verify_all=True)   # --verify-all still re-hashes them
    assert [p for p in hashed if str(p).startswith(str(other)) and "/weights/" in str(p)]
