"""The suite's tiers (tests/tiers.py): the fast tier fails a test that compiles C++ or runs long without the `slow`
marker, leaves out the marked ones and the ones taking a bundle fixture, and a run's cost counts the graphs the
compile caches under its temp folder gained."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.tiers import compiled_graphs

COMPILES = """
import os, subprocess
import pytest

def test_compiles_unmarked():
    # what inductor does for a graph: run $CXX on a source file
    subprocess.run([os.environ.get("CXX", "g++"), "-c", "kernel.cpp"])

@pytest.mark.slow
def test_compiles_marked():
    subprocess.run([os.environ.get("CXX", "g++"), "-c", "kernel.cpp"])

def test_takes_a_bundle(bundle):
    pass

@pytest.fixture
def bundle():
    raise AssertionError("the bundle fixture ran in the fast tier")

def test_fast():
    assert os.environ["CXX"].endswith("refusing_cxx")
"""

SLEEPS = """
import time

def test_sleeps():
    time.sleep(1.5)
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    """Run a pytest of its own over `source` with the tiers plugin, as this suite's would (the outer run's fast
    tier, when there is one, not inherited)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CXX", "g++")
    for name in [n for n in os.environ if n.startswith("PYTEST_") or n == "QIC_REFUSED_CXX_LOG"]:
        monkeypatch.delenv(name)   # the outer run's: its xdist worker, its current test, its fast tier's log

    def run(source: str, *args, env: dict | None = None):
        pytester.makepyfile(test_inner=source)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        return pytester.runpytest_subprocess("-p", "tests.tiers", "-p", "no:cacheprovider", "-p", "no:xdist", *args)
    return run


def test_the_fast_tier_fails_an_unmarked_compile_and_leaves_the_marked_out(inner):
    result = inner(COMPILES, "-m", "not slow")
    result.assert_outcomes(passed=1, failed=1, deselected=2)
    result.stdout.fnmatch_lines(["*make check: test_inner.py::test_compiles_unmarked compiled C++ (a graph) in "
                                 "the fast tier: mark it @pytest.mark.slow*"])


def test_outside_the_fast_tier_nothing_is_refused(inner):
    result = inner(COMPILES, "-k", "compiles")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["suite cost: * s wall", "*graphs compiled: 0, *"])


def test_the_fast_tier_fails_a_test_over_its_ceiling(inner):
    result = inner(SLEEPS, "-m", "not slow", env={"QIC_FAST_TEST_SECONDS": "0.1"})
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_sleeps took 2 s in the fast tier (ceiling * s at this load*"])
    assert inner(SLEEPS, "-m", "not slow", env={"QIC_FAST_TEST_SECONDS": "5"}).ret == 0


def _entry(cache, key: str, seconds: float, adopted: bool = False, mtime: float | None = None,
           backend: str = "inductor"):
    d = cache / "graphs" / key
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"compile_seconds": seconds, "backend": {"backend": backend}}))
    if adopted:
        (d / "origin.json").write_text("{}")
    (d / "done").write_text("")
    if mtime is not None:
        os.utime(d / "done", (mtime, mtime))


def test_a_runs_graphs_are_the_cache_entries_it_finished_each_key_once():
    tmp_path = Path(tempfile.mkdtemp())   # outside this run's temp folder: its summary counts none of these
    start = time.time() - 1
    _entry(tmp_path / "a" / "cache", "k1", 20.0)
    _entry(tmp_path / "b" / "cache", "k1", 20.0)          # a copy of the same cache: one graph
    _entry(tmp_path / "b" / "cache", "k2", 15.5)
    _entry(tmp_path / "b" / "cache", "k6", 0.5, backend="export")          # counted apart: a save, not a compile
    _entry(tmp_path / "c" / "cache", "k3", 30.0, adopted=True)                # pulled from a store, not compiled
    _entry(tmp_path / "d" / "cache", "k4", 30.0, mtime=start - 3600)          # from an earlier run
    (tmp_path / "bundle" / "graphs" / "denoiser").mkdir(parents=True)      # a bundle's graph folder: no entry
    (tmp_path / "fake" / "graphs" / "k5").mkdir(parents=True)                # a test's fake entry
    (tmp_path / "fake" / "graphs" / "k5" / "meta.json").write_text("{}")
    (tmp_path / "fake" / "graphs" / "k5" / "done").write_text("")
    try:
        assert compiled_graphs(tmp_path, start) == {"inductor": (2, 35.5), "export": (1, 0.5)}
    finally:
        shutil.rmtree(tmp_path)
