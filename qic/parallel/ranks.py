"""Process groups for tensor-parallel runs: join under torchrun, or spawn ranks on loopback.

Run-time safe: imports torch.distributed and multiprocessing only (no model or compiler code), so
qic.runtime can launch and join ranks.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qic.errors import ConfigError, QicError

# A rank that dies mid-run must not hang its peers: gloo collectives give up after this long (a peer
# whose process exits is usually noticed at once, from the closed connection).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)


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

    def __init__(self, outcomes: list[RankOutcome]):
        self.outcomes = outcomes
        lines = []
        for o in outcomes:
            if o.ok:
                continue
            if o.error:
                lines.append(f"rank {o.rank}: {o.error}")
            else:
                lines.append(f"rank {o.rank}: exited with code {o.exitcode} without a result")
        super().__init__("tensor-parallel run failed: " + "; ".join(lines))


def _child(fn, rank: int, tp: int, port: int, threads: int, timeout_s: float, backend: str, args, q) -> None:
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
          pg_timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str = "gloo", notify: int | None = None) -> list:
    """Run fn(rank, tp, *args) in `tp` fresh processes joined in one process group on loopback.

    fn must be importable by name (a module-level function); its return value must pickle. Each rank
    runs with `threads` torch threads and a process group whose collectives give up after
    `pg_timeout`. Returns the ranks' return values in rank order. If any rank raises or dies (or the
    whole run exceeds `timeout` seconds; None: no limit), raises RankFailure naming each failing rank's
    error; the ranks still running are then terminated.

    notify: a signal sent to the ranks still running as soon as one fails, for ranks that would not
    otherwise find out (a server's rank 0 waits on HTTP, not on a collective); they then get `pg_timeout`
    to finish before they are terminated. Without it they fail through their next collective.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, tp, port, threads, pg_timeout.total_seconds(), backend, args, q),
                         daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    start = time.monotonic()
    deadline = start + (timeout if timeout is not None else float("inf"))

    def record(r: int, outcome: RankOutcome) -> None:
        nonlocal deadline
        if notify is not None and not outcome.ok and all(o.ok for o in outcomes.values()):   # the first failure
            for other, p in enumerate(procs):
                if other != r and other not in outcomes and p.is_alive():
                    os.kill(p.pid, notify)
            deadline = min(deadline, time.monotonic() + pg_timeout.total_seconds())
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
        q.close()
    ordered = [outcomes[r] for r in range(tp)]
    for o, p in zip(ordered, procs):
        o.exitcode = p.exitcode
    if not all(o.ok for o in ordered):
        raise RankFailure(ordered)
    return [o.value for o in ordered]


def _outcome(kind, rank, payload, err, tb, secs) -> RankOutcome:
    if kind == "ok":
        return RankOutcome(rank, True, value=pickle.loads(payload), seconds=secs)
    return RankOutcome(rank, False, error=err, traceback=tb, seconds=secs)
