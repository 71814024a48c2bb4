"""Stage 2's compile workers: the graphs of one build compiled side by side in worker processes.

A graph's compile is mostly single-threaded (inductor's Python lowering, then g++ on its wrapper and kernels), so a
build of several graphs used one core of the machine's. With workers, the build process still does everything
that touches its own state in order (memo lookups, binding weights, tracing on its fake process group, sealing
entries), and hands each traced graph that its back end can compile elsewhere (Backend.compile_task) to a pool of
spawned processes, one graph each at a time. Spawned, not forked: the build process has computed (OpenMP's
threads, a fake process group), which a fork would carry along half-working.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import tempfile
import threading
from pathlib import Path

from qic.errors import ConfigError

# Everything in the build process that runs torch (binding, tracing, an in-process compile) holds this lock: the
# stage runs one thread per worker, and torch.export and inductor keep global state.
TORCH_LOCK = threading.RLock()

JOBS_ENV = "QIC_COMPILE_JOBS"
# Memory a worker is given room for: a default build's largest process (build or worker) peaked at 0.42 GB
# (/usr/bin/time, 2026-12-06); a real model's graphs, thousands of nodes, take more (not measured here). A worker
# is only started where this much memory is free for it.
WORKER_MEMORY = 3 << 30


def default_jobs() -> int:
    """Compile workers when --jobs is not given: $QIC_COMPILE_JOBS, else one per core this process may use,
    as many as the free memory holds (WORKER_MEMORY each)."""
    if os.environ.get(JOBS_ENV):
        return checked_jobs(os.environ[JOBS_ENV], f"{JOBS_ENV}={os.environ[JOBS_ENV]}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, _available_memory() // WORKER_MEMORY))


def checked_jobs(value, source: str) -> int:
    """A compile-worker count (--jobs, $QIC_COMPILE_JOBS): a whole number of at least 1, else one line naming
    `source`."""
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"{source}: must be a whole number of at least 1")
    return int(value)


def plan_workers(spec, jobs: int | None = None) -> int:
    """The compile workers a build of `spec` would compile its graphs on, for the plan's estimate (`jobs`: --jobs):
    its back end's graphs compile in workers where they hold no collectives, so a TP or parallel-layout build is
    planned as one at a time."""
    from qic import backends
    if not getattr(backends.info(spec.backend), "COMPILES_IN_WORKERS", False) or spec.tp > 1 or not spec.layout.plain:
        return 1
    return default_jobs() if jobs is None else jobs


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return WORKER_MEMORY   # unknown: as if one worker fits


def _start_worker() -> None:
    """A worker imports the compiler as it starts, while the build process traces the next graphs."""
    import torch._inductor.compile_fx  # noqa: F401


class CompileWorkers:
    """`jobs` worker processes, started at the first graph handed to them; a `with` block stops them."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._pool = None
        self._started = threading.Lock()
        self._scratch = tempfile.TemporaryDirectory(prefix="qic-compile-")

    def compile(self, backend, traced, out_dir: Path):
        """backend.compile(traced, out_dir), in a worker where the back end can hand the graph over, else here."""
        scratch = Path(tempfile.mkdtemp(dir=self._scratch.name))
        with TORCH_LOCK:
            task = backend.compile_task(traced, out_dir, scratch)
            if task is None:
                return backend.compile(traced, out_dir)
        fn, args = task
        return self._executor().submit(fn, *args).result()

    def _executor(self):
        with self._started:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker)
            return self._pool

    @property
    def started(self) -> int:
        """Worker processes started (0 until a graph was handed to them; one more is spawned per graph submitted
        while all are busy, up to `jobs`)."""
        return 0 if self._pool is None else len(self._pool._processes or {})   # private: no public count

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self._pool is not None:
            interrupted = exc_type is not None and not issubclass(exc_type, Exception)
            if interrupted:
                # Ctrl-C: the compiles still running are stopped, not waited for (their staging directories are
                # removed as their threads see the broken pool). A failed graph lets the others finish theirs
                # (cached for the next build) and starts none.
                for process in list((self._pool._processes or {}).values()):
                    process.terminate()
            self._pool.shutdown(wait=not interrupted, cancel_futures=True)
        self._scratch.cleanup()
