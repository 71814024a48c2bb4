"""Process groups for tensor-parallel runs: join under torchrun, or spawn ranks on loopback.

Run-time safe: imports torch.distributed and multiprocessing only (no model or compiler code), so
qic.runtime can launch and join ranks.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qic.errors import ConfigError, QicError

# A rank that dies mid-run must not hang its peers: gloo collectives give up after this long (a peer
# whose process exits is usually noticed at once, from the closed connection). Every group qic creates
# has it (new_group below), not torch's 30-minute default for groups created without a timeout.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)
# After the first rank fails, the others get the collective timeout to notice and this long to report.
REPORT_GRACE_S = 10.0
# The ranks' stderr reaches ours this late, so that what a rank's death sets off in its peers (C++ warnings
# from gloo, c10d and the AOTInductor runtime, printed the moment they see the closed connection) is held back:
# the spawner notices a death within its 0.2 s poll plus 0.5 s for a last message, well inside this.
STDERR_LAG_S = 2.0
# How spawn() starts ranks where its caller does not say: "spawn" (fresh interpreters, each importing torch again),
# or "forkserver" (forks of one started interpreter that imported FORKSERVER_PRELOAD once, without computing). The
# tests set QIC_RANKS_START=forkserver for the ranks they spawn from their own processes, which have computed and
# so cannot fork them (tests/conftest.py).
START_ENV = "QIC_RANKS_START"
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "numpy", "qic.parallel.ranks"]


def group_name(group=None) -> str:
    """The registered name of a process group (default: the world group)."""
    if isinstance(group, str):
        return group
    if not dist.is_initialized():
        raise ConfigError("tensor parallelism needs an initialised torch.distributed process group",
                          "call qic.parallel.tp.init_from_env() under torchrun, or use qic.parallel.tp.spawn")
    return (group or dist.group.WORLD).group_name


# ------------------------------------------------------------------------------------------- groups

def init_from_env(backend: str = "gloo", timeout: datetime.timedelta = DEFAULT_TIMEOUT):
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Returns (rank, world_size, group_name). Reuses an existing default group.
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(f"tensor parallelism: environment lacks {', '.join(missing)}",
                              "launch with torchrun --nproc-per-node N")
        dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), group_name()


def group_timeout(group=None) -> datetime.timedelta:
    """The timeout a process group (default: the world group) was created with; DEFAULT_TIMEOUT where torch
    does not say (a fake group for tracing, a backend without gloo's options)."""
    try:
        return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


def new_group(ranks: list[int] | None = None, timeout: datetime.timedelta | None = None, backend: str | None = None):
    """dist.new_group with the world group's timeout unless told another. Without a timeout torch gives a new
    group gloo's 30 minutes, so a dead rank's peers would sit that long in a collective on it. Every process
    group qic creates is made here (a test checks the sources)."""
    return dist.new_group(ranks, timeout=timeout or group_timeout(), backend=backend)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: object = None
    error: str | None = None          # "Type: message" of the exception the rank raised
    traceback: str | None = None
    exitcode: int | None = None
    seconds: float | None = None      # time in fn (None when the rank sent nothing)


class RankFailure(QicError):
    """One or more spawned ranks raised, died or timed out. `.outcomes` holds every rank's result."""

    def __init__(self, outcomes: list[RankOutcome], stderr_dir: Path | None = None):
        self.outcomes, self.stderr_dir = outcomes, stderr_dir
        # One line, the ranks that died first: their peers' errors (a closed connection, a timeout) follow
        # from them. A rank's multi-line error keeps its first line here, all of it in .outcomes; what the
        # ranks printed after the first failure is in their stderr files, not on the terminal.
        failed = sorted((o for o in outcomes if not o.ok), key=lambda o: (o.error is not None, o.rank))
        where = f" (the ranks' stderr: {stderr_dir})" if stderr_dir is not None else ""
        super().__init__("tensor-parallel run failed: " + "; ".join(_describe(o) for o in failed) + where)


def _describe(o: RankOutcome) -> str:
    if o.error:
        return f"rank {o.rank}: {o.error.splitlines()[0]}"
    how = f"exited with code {o.exitcode}"
    if o.exitcode is not None and o.exitcode < 0:
        try:
            how += f" ({signal.Signals(-o.exitcode).name})"
        except ValueError:
            pass
    return f"rank {o.rank}: {how} without a result"


def _die_with_parent(parent: int | None) -> None:
    """Linux: have the kernel SIGKILL this rank when the process that spawned it dies, however it dies
    (SIGKILL of `qic run` or `qic serve`, the OOM killer), so no rank outlives it holding memory or a port.
    SIGKILL because a rank may sit in a collective's C++ wait or ignore SIGTERM (serve's followers do). The
    kernel watches the thread that started the rank, and spawn() waits for its ranks on that thread. The
    parent may already have died before prctl: then this process has been re-parented and goes now.
    parent None: a forkserver's rank, whose parent is the fork server (it exits when the spawner does)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1   # <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


class _StderrRelay:
    """Each rank's stderr (file descriptor 2, so C++ output too) goes to a file of its own; a thread copies each
    finished line to this process's stderr STDERR_LAG_S after it appeared. At a rank's failure the copying stops:
    the peers' reaction to it would only surround qic's one-line error. The files stay, named in that error."""

    def __init__(self, world: int):
        self.dir = Path(tempfile.mkdtemp(prefix="qic-ranks-"))
        self.paths = [self.dir / f"rank{r}.stderr" for r in range(world)]
        for path in self.paths:
            path.touch()
        self._offsets = [0] * world
        self._pending: list[tuple[float, bytes]] = []   # (when first seen, line), oldest first
        self._held = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qic-rank-stderr", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _read(self) -> None:
        now = time.monotonic()
        for r, path in enumerate(self.paths):
            with open(path, "rb") as f:
                f.seek(self._offsets[r])
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1      # whole lines only: a rank may be mid-write
            self._offsets[r] += end
            self._pending += [(now, line) for line in chunk[:end].splitlines(keepends=True)]

    def _write(self, older_than: float) -> None:
        ready = [line for seen, line in self._pending if seen <= older_than]
        self._pending = self._pending[len(ready):]
        if ready:
            sys.stderr.flush()
            os.write(2, b"".join(ready))   # fd 2, where the ranks' C++ would have written

    def _run(self) -> None:
        while not self._done.wait(0.1) and not self._held.is_set():
            self._read()
            self._write(time.monotonic() - STDERR_LAG_S)

    def hold(self) -> None:
        """A rank failed: copy nothing more."""
        self._held.set()

    def close(self, failed: bool) -> None:
        """All ranks are gone: copy the rest at once (none after a failure); keep the files only after one."""
        self._done.set()
        self._thread.join()
        if not failed and not self._held.is_set():
            self._read()
            self._write(float("inf"))
        if not failed:
            shutil.rmtree(self.dir, ignore_errors=True)


def _stderr_to(path: str) -> None:
    """Point this process's file descriptor 2 at `path` (C++ libraries write there, not to sys.stderr)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def _default_signal_handlers() -> None:
    """A forked rank starts with the signal handlers a spawned one has (its parent's, such as serve's SIGTERM
    forwarding, act on the parent's children)."""
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _child(fn, parent: int, rank: int, tp: int, port: int, threads: int, timeout_s: float, backend: str, args,
           q, stderr_path: str | None = None, start: str = "spawn", env: dict | None = None) -> None:
    _die_with_parent(None if start == "forkserver" else parent)
    if start == "fork":
        _default_signal_handlers()
    if env is not None:   # a fork server's rank: the spawner's environment now, not the server's when it started
        os.environ.clear()
        os.environ.update(env)
    if stderr_path is not None:
        _stderr_to(stderr_path)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(tp), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(tp)})
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname resolves to
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        init_from_env(backend, datetime.timedelta(seconds=timeout_s))
        value = fn(rank, tp, *args)
        msg = ("ok", rank, pickle.dumps(value), None, None, time.perf_counter() - t0)
    except BaseException as e:  # report everything, including SystemExit from fn
        msg = ("err", rank, None, f"{type(e).__name__}: {e}", traceback.format_exc(), time.perf_counter() - t0)
    try:
        q.put(msg)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable, tp: int, *args, threads: int = 1, timeout: float | None = 600.0,
          pg_timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str = "gloo", notify: int | None = None,
          start: str | None = None) -> list:
    """Run fn(rank, tp, *args) in `tp` fresh processes joined in one process group on loopback.

    start: "spawn" (default; or $QIC_RANKS_START) starts each rank afresh, importing torch again (about 2 s of a
    core); "fork" forks them from this process, which has torch and fn's module imported already. Fork only from a
    caller that has run no torch computation yet: OpenMP's thread pool, once started, does not survive a fork.
    Where this process runs Python threads (a lock one of them holds would stay held in the ranks) or the
    platform has no fork, they are spawned instead. "forkserver": forks of a server process started once, which
    imported FORKSERVER_PRELOAD; for callers that have computed.

    fn must be importable by name (a module-level function); its return value must pickle. Each rank
    runs with `threads` torch threads and a process group whose collectives give up after
    `pg_timeout`. Returns the ranks' return values in rank order. If any rank raises or dies (or the
    whole run exceeds `timeout` seconds; None: no limit), raises RankFailure naming each failing rank's
    error, the ranks that died first. Once one rank fails, the others get `pg_timeout` (their collectives'
    limit) and REPORT_GRACE_S to report; those still running are then killed. Every rank dies with this
    process (_die_with_parent).

    notify: a signal sent to the ranks still running as soon as one fails, for ranks that would not
    otherwise find out (a server's rank 0 waits on HTTP, not on a collective). Without it they fail through
    their next collective.
    """
    start = start or os.environ.get(START_ENV) or "spawn"
    if start not in ("spawn", "fork", "forkserver"):
        raise ConfigError(f"{START_ENV}={start}: ranks start by spawn, fork or forkserver")
    unavailable = start != "spawn" and start not in mp.get_all_start_methods()
    if unavailable or (start == "fork" and threading.active_count() > 1):   # a held lock would stay held in a fork
        start = "spawn"
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    q = ctx.Queue()
    port = free_port()
    relay = _StderrRelay(tp)
    procs = [ctx.Process(target=_child, args=(fn, os.getpid(), r, tp, port, threads, pg_timeout.total_seconds(),
                                              backend, args, q, str(relay.paths[r]), start,
                                              dict(os.environ) if start == "forkserver" else None),
                         daemon=True) for r in range(tp)]
    sys.stdout.flush()   # a forked rank would write what is still buffered here a second time
    sys.stderr.flush()
    for p in procs:
        p.start()
    relay.start()   # its thread after the fork: a forked rank gets this thread's state but not the thread
    outcomes: dict[int, RankOutcome] = {}
    start = time.monotonic()
    deadline = start + (timeout if timeout is not None else float("inf"))

    def record(r: int, outcome: RankOutcome) -> None:
        nonlocal deadline
        if not outcome.ok and all(o.ok for o in outcomes.values()):   # the first failure
            relay.hold()
            if notify is not None:
                for other, p in enumerate(procs):
                    if other != r and other not in outcomes and p.is_alive():
                        os.kill(p.pid, notify)
            deadline = min(deadline, time.monotonic() + pg_timeout.total_seconds() + REPORT_GRACE_S)
        outcomes[r] = outcome

    try:
        while len(outcomes) < tp and time.monotonic() < deadline:
            try:
                kind, rank, payload, err, tb, secs = q.get(timeout=0.2)
            except queue_mod.Empty:
                # A rank that died without sending anything (os._exit, a signal, a crash in C++).
                for r, p in enumerate(procs):
                    if r not in outcomes and p.exitcode is not None:
                        try:  # it may have sent just before exiting
                            kind, rank, payload, err, tb, secs = q.get(timeout=0.5)
                        except queue_mod.Empty:
                            record(r, RankOutcome(r, False, exitcode=p.exitcode))
                            continue
                        record(rank, _outcome(kind, rank, payload, err, tb, secs))
                continue
            record(rank, _outcome(kind, rank, payload, err, tb, secs))
        waited = time.monotonic() - start
        for r in range(tp):
            if r not in outcomes:
                outcomes[r] = RankOutcome(r, False, error=f"TimeoutError: no result within {waited:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():   # serve's followers ignore SIGTERM; a rank stuck in C++ may not get to it
                p.kill()
                p.join(timeout=5)
        q.close()
        failed = len(outcomes) < tp or not all(o.ok for o in outcomes.values())
        relay.close(failed)
    ordered = [outcomes[r] for r in range(tp)]
    for o, p in zip(ordered, procs):
        o.exitcode = p.exitcode
    if not all(o.ok for o in ordered):
        raise RankFailure(ordered, relay.dir)
    return [o.value for o in ordered]


def _outcome(kind, rank, payload, err, tb, secs) -> RankOutcome:
    if kind == "ok":
        return RankOutcome(rank, True, value=pickle.loads(payload), seconds=secs)
    return RankOutcome(rank, False, error=err, traceback=tb, seconds=secs)
