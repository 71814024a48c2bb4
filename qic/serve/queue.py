"""The bounded request queue: admission (429 when full), cancellation, and grouping into batches.

Everything here runs on the event loop's thread except the runner, which one worker thread calls with
one group at a time, so the graphs never run concurrently and the queue needs no locks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass(eq=False)
class Job:
    item: object                   # what the runner gets (a qic Request in the server)
    key: Hashable                  # jobs with equal keys may run in one batch
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None   # when the worker took it
    batch: int = 0                 # the size of the batch it ran in


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after} s")
        self.retry_after = retry_after


class Unavailable(Exception):
    """The runner can make no more images (a tensor-parallel rank has died); the message says why.
    Raised by run_batch, or passed to Scheduler.fail, it fails every job for good."""


def take_group(pending: list[Job], batch_sizes: Sequence[int]) -> list[Job]:
    """Remove and return the next batch: the oldest job plus the oldest jobs compatible with it.

    The batch size is the largest of `batch_sizes` (sizes the bundle has graphs for; 1 is always
    allowed) that the compatible jobs fill, so no graph runs padded rows. FIFO for the head job, so a
    request that nothing matches is never starved by a stream of mutually compatible ones.
    """
    if not pending:
        return []
    head = pending[0]
    compatible = [j for j in pending if j.key == head.key]
    size = max(s for s in {1, *batch_sizes} if s <= len(compatible))
    group = compatible[:size]
    taken = set(map(id, group))
    pending[:] = [j for j in pending if id(j) not in taken]
    return group


def compute_thread() -> ThreadPoolExecutor:
    """The one thread that does all of a serving rank's torch work: loading, warm-up and every batch.

    Why one: GNU OpenMP (torch's CPU thread pool) gives each thread that enters a parallel region a team
    of its own. Warm-up on the main thread and requests on a worker made two teams of
    torch.get_num_threads() threads each; with more OpenMP threads than CPUs, libgomp stops spinning
    between regions and sleeps instead, so every kernel paid a futex wake-up. Measured on the tiny bundle
    with 2 threads on 2 cores: 196 ms per image on the worker after the main thread had run torch, 53 ms
    on a thread that alone ran it (docs/benchmarks.md, "Serving")."""
    return ThreadPoolExecutor(1, thread_name_prefix="qic-runner")


class Scheduler:
    """Admits up to `capacity` waiting jobs and feeds them, grouped, to `run_batch` on one thread.

    run_batch(items, key) -> list of outputs, one per item, in order (key: the group's batch key, which its jobs
    share). An exception fails the whole group;
    Unavailable fails every job, queued and later ones too.
    """

    def __init__(self, run_batch: Callable[[list, Hashable], list], capacity: int, batch_sizes: Sequence[int] = (1,),
                 executor: ThreadPoolExecutor | None = None, on_fail: Callable[[Exception], None] | None = None):
        """executor: the compute_thread run_batch runs on (the server passes the one it loaded and warmed
        the bundle on; default: a new one). on_fail: called once fail() has failed the jobs (the server stops)."""
        self.on_fail = on_fail
        self.run_batch = run_batch
        self.capacity = capacity
        self.batch_sizes = tuple(sorted({1, *batch_sizes}))
        self.pending: list[Job] = []
        self.current: list[Job] = []      # the batch now executing
        self.failed: Exception | None = None   # set by fail(): no job will run again
        self.ready = False                # set once start()'s warm-up has run: batches may run
        self.job_seconds = 1.0            # running mean of run time per job, for Retry-After
        self._wake = asyncio.Event()
        self._executor = executor or compute_thread()
        self._task: asyncio.Task | None = None

    def submit(self, items: list[tuple[object, Hashable]]) -> list[Job]:
        """Queue all items or none (a request's n images are admitted together)."""
        if self.failed is not None:
            raise self.failed
        if len(self.pending) + len(items) > self.capacity:
            waiting = len(self.pending) + self.running
            raise QueueFull(max(1, math.ceil(self.job_seconds * waiting)))
        loop = asyncio.get_running_loop()
        jobs = [Job(item, key, loop.create_future()) for item, key in items]
        self.pending.extend(jobs)
        self._wake.set()
        return jobs

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started (its client left or timed out). False if it already runs."""
        if job in self.pending:
            self.pending.remove(job)
            if not job.future.done():
                job.future.cancel()
            return True
        return False

    @property
    def running(self) -> int:
        return len(self.current)

    def fail(self, error: Exception) -> None:
        """The runner can make no more images (a tensor-parallel rank died): every queued and running job
        fails with `error` now, rather than when the stuck batch gives up, and so does every later submit.
        The first failure is the one reported (a signal may follow the broken batch that showed it)."""
        if self.failed is not None:
            return
        self.failed = error
        for job in [*self.pending, *self.current]:
            if not job.future.done():
                job.future.set_exception(error)
        self.pending.clear()
        if self._task:
            self._task.cancel()   # no next batch; the one running, if any, is left to the executor
        if self.on_fail:
            self.on_fail(error)

    def start(self, warm_up: Callable[[], None] | None = None) -> None:
        """Start taking batches, on the event loop. warm_up: run first on the executor (qic serve's: every graph once,
        and at tp > 1 the control group); until it returns, requests wait in the queue (cancellable, and their queue
        time counted as such) and `ready` is False; if it raises, fail() with the reason and run nothing."""
        self._task = asyncio.get_running_loop().create_task(self._work(warm_up))

    async def stop(self) -> None:
        """Called after the HTTP server has drained: nothing is waiting on the jobs any more."""
        for job in list(self.pending):
            self.cancel(job)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def _work(self, warm_up: Callable[[], None] | None) -> None:
        loop = asyncio.get_running_loop()
        if warm_up is not None:
            try:
                await loop.run_in_executor(self._executor, warm_up)
            except Exception as e:
                self.fail(Unavailable(f"warming up failed: {type(e).__name__}: {e}"))
                return
        self.ready = True
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            group = take_group(self.pending, self.batch_sizes)
            t = time.perf_counter()
            for job in group:
                job.started, job.batch = t, len(group)
            self.current = group
            try:
                outputs = await loop.run_in_executor(self._executor, self.run_batch, [j.item for j in group],
                                                     group[0].key)
                if len(outputs) != len(group):
                    raise RuntimeError(f"runner returned {len(outputs)} outputs for {len(group)} jobs")
            except Unavailable as e:
                self.fail(e)
                return
            except Exception as e:  # the group fails; the server and the queue go on
                for job in group:
                    if not job.future.done():
                        job.future.set_exception(e)
            else:
                for job, out in zip(group, outputs):
                    if not job.future.done():
                        job.future.set_result(out)
                self.job_seconds = 0.8 * self.job_seconds + 0.2 * (time.perf_counter() - t) / len(group)
            finally:
                self.current = []
