"""The suite's two tiers and what a run cost (loaded by tests/conftest.py).

`slow` marks a test that compiles a graph, starts a server or a rank, or otherwise runs for long; `make check`
runs the rest (`-m "not slow"`), `make test` both. A test is marked slow by hand or, when it takes a fixture
that builds a bundle (SLOW_FIXTURES), here at collection.

The fast tier guards itself, so that a test that compiles without the marker fails it loudly instead of
slowing it silently: C++ compilers are replaced by tests/fakes/refusing_cxx (inductor compiles through $CXX),
which refuses and logs the test that asked, and a test over FAST_TEST_SECONDS fails naming its time.

Every run ends with its cost: wall time, the ten slowest files (with the diffusers pipelines each ran and the
processes it started), and how many graphs were compiled into compile caches under the run's temp folder
(each cache entry's meta.json records its compile time; entries adopted from another store are not counted).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.zygote import RUN_LOG

ROOT = Path(__file__).resolve().parent.parent
REFUSING_CXX = ROOT / "tests" / "fakes" / "refusing_cxx"

# Fixtures that build a bundle (tests/conftest.py): a test that takes one is in the slow tier.
SLOW_FIXTURES = frozenset({
    "bundle", "bundle_export", "bundle_two_res", "bundle_exact", "bundle_tp2", "bundle_batch2",
    "q21_bundle", "q21_bundle_tp2", "q21_bundle_cfgp", "shapes_bundle", "shapes_bundle_export",
    "shapes_bundle_batch2",
})

# The fast tier's ceiling for one test (setup and call) on an unloaded machine: about the cost of compiling one
# tiny graph on two cores, so a test that compiles, serves or spawns ranks cannot hide under it. It grows with
# the load beyond one process a core (ceiling()), as everything slows alike. QIC_FAST_TEST_SECONDS overrides it.
FAST_TEST_SECONDS = float(os.environ.get("QIC_FAST_TEST_SECONDS", "20"))


def ceiling() -> float:
    return FAST_TEST_SECONDS * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


_start = time.time()
_counts = {"processes": 0, "pipelines": 0}
_refused_log: Path | None = None   # the fast tier's record of refused compiles (tests/fakes/refusing_cxx writes it)


def count_process() -> None:
    """A process started some other way than subprocess or spawn (tests/zygote_client.py's forks)."""
    _counts["processes"] += 1


def fast_tier(config) -> bool:
    return "not slow" in (config.getoption("markexpr") or "")


@pytest.hookimpl(trylast=True)   # after pytest's own (the temp folder's factory)
def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles a graph, starts a server or a rank, or runs long; "
                                       "`make check` leaves these out")
    _count_processes_and_pipelines()
    if getattr(config.option, "loadscopereorder", None):   # xdist's loadfile takes LONGEST_FIRST's order instead
        config.option.loadscopereorder = False
    # Each forked run's CPU (tests/zygote.py), in one file for the whole run: the workers inherit the variable.
    os.environ.setdefault(RUN_LOG, str(Path(config._tmp_path_factory.getbasetemp()) / "runs.jsonl"))
    if fast_tier(config):   # xdist's workers inherit the controller's log through the environment
        global _refused_log
        _refused_log = Path(os.environ.setdefault("QIC_REFUSED_CXX_LOG", str(Path(
            config._tmp_path_factory.getbasetemp()) / "refused-cxx.log")))
        _refused_log.touch()
        os.environ["CXX"] = str(REFUSING_CXX)
        if "torch._inductor.config" in sys.modules:   # read at its import: set it too
            sys.modules["torch._inductor.config"].cpp.cxx = (None, str(REFUSING_CXX))


# The files that cost the most worker time (docs/benchmarks.md, "The suite"), longest first: xdist's workers take
# files in this order (loadfile, its own reordering by test count switched off in pytest_configure), then the rest
# in collection order, short ones last, so the two workers end together. It also starts the two workers on files
# that need different session bundles: two files that both need the tiny `bundle` first left one worker waiting a
# minute for the other's compile. A file missing from the list is only scheduled later; the order checks nothing.
LONGEST_FIRST = (
    "test_benchmarks.py", "test_step_cache.py", "test_qwen_image_edit.py", "test_qwen_image_21_conditions.py",
    "test_run.py", "test_shapes_edit_model.py", "test_compiled_layouts.py", "test_serve.py", "test_img2img.py",
    "test_shapes_model.py", "test_build.py", "test_warm.py", "test_neuron_xla.py", "test_neuron_xla_q21.py",
    "test_qwen_image_21_family.py", "test_tp.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


def _count_processes_and_pipelines() -> None:
    """Count the processes this test process starts (subprocesses and spawned ranks) and the diffusers pipelines it
    runs (a pipeline's __call__ opens its progress bar once), the latter from diffusers' import on (importing it
    here would cost each pytest process 3 s)."""
    import multiprocessing.popen_forkserver as forkserver
    import multiprocessing.popen_spawn_posix as spawn

    def counted(owner, name, what):
        original = getattr(owner, name)

        def wrapper(*args, **kw):
            _counts[what] += 1
            return original(*args, **kw)
        setattr(owner, name, wrapper)

    counted(subprocess.Popen, "__init__", "processes")
    counted(spawn.Popen, "_launch", "processes")
    counted(forkserver.Popen, "_launch", "processes")   # ranks from the fork server (QIC_RANKS_START, conftest)
    sys.meta_path.insert(0, _OnImport("diffusers.pipelines.pipeline_utils",
                                      lambda m: counted(m.DiffusionPipeline, "progress_bar", "pipelines")))


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once module `name` has been imported, wherever that happens."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.then(module)
        spec.loader.exec_module = exec_module
        return spec


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._cost_before = dict(_counts)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.when == "teardown":   # reports travel from xdist's workers with their user_properties
        rep.user_properties.append(("cost", {k: _counts[k] - item._cost_before[k] for k in _counts}))
        return
    if not fast_tier(item.config):
        return
    problem = _refused_compile(item, rep.when)
    seconds = getattr(item, "_tier_seconds", 0.0) + rep.duration
    item._tier_seconds = seconds
    if problem is None and rep.when == "call" and seconds > ceiling():
        problem = (f"took {seconds:.0f} s in the fast tier (ceiling {ceiling():.1f} s at this load, "
                   "QIC_FAST_TEST_SECONDS): mark it @pytest.mark.slow, or make it cheaper")
    if problem:
        rep.outcome = "failed"
        rep.longrepr = f"make check: {item.nodeid} {problem}\n\n{rep.longrepr or ''}"


def _refused_compile(item, when: str) -> str | None:
    if not any(line.startswith(f"{item.nodeid} ({when})") for line in _refused_log.read_text().splitlines()):
        return None
    return "compiled C++ (a graph) in the fast tier: mark it @pytest.mark.slow, or take a fixture that builds"


# ---- what the run cost ----------------------------------------------------------------------------------

_files: dict = defaultdict(lambda: {"seconds": 0.0, "processes": 0, "pipelines": 0})


def pytest_runtest_logreport(report):
    f = _files[report.nodeid.split("::")[0]]
    f["seconds"] += report.duration
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cost":
                f["processes"] += value["processes"]
                f["pipelines"] += value["pipelines"]


def compiled_graphs(root: Path, since: float) -> dict[str, tuple[int, float]]:
    """back end -> (graphs compiled, their compile seconds): compile-cache entries under `root` finished since
    `since`, as qic.builder.compile writes them (meta.json with the back end's identity and the compile time; tests'
    fake entries lack them), adopted ones (origin.json) left out, each key once (a test that copies a cache holds it
    twice). By back end, since an export entry takes a second and an inductor one a minute."""
    seen: dict = {}
    for done in root.rglob("graphs/*/done"):
        entry = done.parent
        if done.stat().st_mtime < since or (entry / "origin.json").exists() or entry.name in seen:
            continue
        try:
            meta = json.loads((entry / "meta.json").read_text())
            seen[entry.name] = (str(meta["backend"]["backend"]), float(meta["compile_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue   # not an entry qic wrote (a test's fake one)
    out: dict = {}
    for backend, seconds in seen.values():
        n, total = out.get(backend, (0, 0.0))
        out[backend] = (n + 1, total + seconds)
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    write = terminalreporter.write_line
    write("")
    write(f"suite cost: {time.time() - _start:.0f} s wall", bold=True)
    runs = _forked_runs(Path(os.environ[RUN_LOG]))
    slowest = sorted(_files.items(), key=lambda kv: -kv[1]["seconds"])[:10]
    for name, f in slowest:
        cpu = sum(r["cpu"] for r in runs if r["test"].split("::")[0] == name)
        write(f"  {f['seconds']:7.1f} s  {name}  ({f['pipelines']} diffusers pipelines run, "
              f"{f['processes']} processes started, {cpu:.0f} s of CPU in forked runs)")
    graphs = compiled_graphs(Path(config._tmp_path_factory.getbasetemp()), _start)
    by_backend = ", ".join(f"{n} {b} ({secs:.0f} s)" for b, (n, secs) in sorted(graphs.items())) or "0"
    write(f"  graphs compiled: {by_backend}, diffusers pipelines run: "
          f"{sum(f['pipelines'] for f in _files.values())}, processes started: "
          f"{sum(f['processes'] for f in _files.values())}")
    by_run: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for r in runs:
        by_run[r["run"]][0] += 1
        by_run[r["run"]][1] += r["cpu"]
        by_run[r["run"]][2] += r["wall"]
    top = sorted(by_run.items(), key=lambda kv: -kv[1][1])[:8]
    write("  forked runs, CPU / wall seconds: " + (", ".join(
        f"{run} x{n} {cpu:.0f} / {wall:.0f}" for run, (n, cpu, wall) in top) or "none"))


def _forked_runs(path: Path) -> list[dict]:
    """The runs tests/zygote.py logged (a line each; a line cut short by a killed run is left out)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    runs = []
    for line in lines:
        try:
            runs.append(json.loads(line))
        except ValueError:
            continue
    return runs
