"""`qic serve BUNDLE`: check, bind, load once, then serve (ready once every graph has run: /health) until SIGTERM
or Ctrl-C drains it.

At tp=N, N ranks are spawned on loopback as `qic run --tp N` does; rank 0 serves HTTP and the others
run what it sends them. The parent forwards SIGTERM to the ranks: rank 0 drains, then releases the
others, and every process exits 0. If a rank dies, the parent signals the rest (PEER_DIED): rank 0
answers 503 to /health and to every waiting request, stops, and the server exits 2 for its supervisor
to restart; the other ranks die of the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from qic.errors import ConfigError, QicError
from qic.manifest import read_bundle
from qic.runtime.heap import keep_freed_blocks
from qic.runtime.launch import bundle_world, spawn_ranks, torchrun_world

# Sent by the parent to the ranks still running when one fails; its default action ends the followers,
# rank 0 handles it (see serve_rank).
PEER_DIED = signal.SIGUSR1


def _check_servable(manifest: dict) -> None:
    """The endpoints run the bundle's host program (qic.serve.runner), which must be able to admit a request
    (`plan`, qic.runtime.programs); one that cannot is refused in one line, before any rank starts."""
    from qic.runtime.programs import program_of, serving
    program = program_of(manifest)
    if not serving(program):
        raise ConfigError(f"this bundle's host program ({program.__name__}) has no `plan`, so qic serve cannot "
                          "admit its requests", "run it with `qic run`")


def run_serve(bundle_path: str, host: str, port: int, tp: int | None, settings, load: dict | None = None,
              sets: dict | None = None) -> None:
    """load: how the bundle is loaded, as `qic run` takes it (device, weights_from, verify_all: Bundle's). sets:
    the named weight sets served beside it ({"named": {name: bundle}, "budget": bytes or None})."""
    load = {k: v for k, v in (load or {}).items() if v is not None}
    ranks = bundle_world(bundle_path, tp, "serve")
    _check_servable(read_bundle(Path(bundle_path)))
    if torchrun_world() is not None:
        raise ConfigError("qic serve starts its own ranks; do not launch it with torchrun",
                          f"run `qic serve {bundle_path}` (it starts the bundle's {ranks} ranks)")
    for name in ("queue", "max_n", "max_batch"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not settings.timeout > 0:
        raise ConfigError("--timeout must be a positive number of seconds")
    keep_freed_blocks()   # before any rank is forked or anything loaded: every rank's steps reuse their buffers
    if ranks == 1:
        serve_rank(0, 1, bundle_path, host, port, settings, load, sets)
        return
    signal.signal(signal.SIGTERM, _forward_to_ranks)
    spawn_ranks(serve_rank, ranks, bundle_path, host, port, settings, load, sets, timeout=None, notify=PEER_DIED)


def _forward_to_ranks(sig, frame) -> None:
    """SIGTERM for the server reaches this parent: pass it on. Rank 0 drains; the others ignore it and
    stop when rank 0 releases them."""
    import multiprocessing
    for child in multiprocessing.active_children():
        os.kill(child.pid, sig)


def serve_rank(rank: int, world: int, bundle_path: str, host: str, port: int, settings,
               load_options: dict | None = None, sets: dict | None = None) -> None:
    if rank > 0:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    else:
        # Binding before loading makes a taken port a one-line error rather than a wasted load.
        sock = _bind(host, port)

    from qic.serve.queue import compute_thread
    from qic.serve.runner import BundleRunner, control_group, follow, load, serve_adapters, warm, weight_sets
    sets = sets or {}

    if rank > 0:   # nothing else to do here: load, warm with the others, then follow rank 0
        # rank 0's order: the bundle, its named sets, then the warm-up (whose all-reduces pair with rank 0's)
        bundle, _ = load(bundle_path, rank, world, None, **(load_options or {}))
        serve_adapters(bundle, sets.get("loras"), sets.get("lora_budget"))
        named = weight_sets(bundle, rank, world, load_options or {}, sets.get("named"), sets.get("budget"))
        warm(bundle)
        follow(bundle, control_group(world), named)
        return

    import uvicorn

    from qic.serve.app import create_app

    _log_to_stderr()
    log = logging.getLogger("qic.serve")
    # Rank 0 answers HTTP on this thread, so its torch work all goes to one other thread (compute_thread says why).
    # The bundle is loaded (verified: a refusal is one line and no port is served) before the port opens; the
    # warm-up and the control group follow on that thread once the server has started, ahead of any batch (a
    # failure stops the server as a dead rank does), and /health says ready once they are done.
    compute = compute_thread()
    bundle, loaded = load(bundle_path, rank, world, compute, **(load_options or {}))
    compute.submit(serve_adapters, bundle, sets.get("loras"), sets.get("lora_budget")).result()
    named = weight_sets(bundle, rank, world, load_options or {}, sets.get("named"), sets.get("budget"), compute)
    runner = BundleRunner(bundle, None, executor=compute, sets=named)
    log.info(f"loaded {bundle_path} (tp={world}, sizes {', '.join(runner.sizes)}) in {loaded:.2f} s; batch sizes "
             f"{list(runner.batch_sizes)} (up to --max-batch {settings.max_batch}); models {', '.join(runner.models)}")

    def warm_up() -> None:   # on the compute thread, ahead of any batch (Scheduler.start)
        t = time.perf_counter()
        try:
            warm(bundle)
            runner.group = control_group(world)   # every rank makes it after its warm-up, in the same order
        except Exception:
            log.exception("warming up failed")
            raise
        log.info(f"warmed every graph in {time.perf_counter() - t:.2f} s: ready")

    def stop(error):   # the runner can make no more images: stop serving; the exit status says so
        log.error(f"unavailable: {error}; stopping")
        server.should_exit = True

    app = create_app(runner, settings, on_fail=stop, warm_up=warm_up)
    # In-flight and queued requests get the request timeout to finish after SIGTERM, then are cut.
    config = uvicorn.Config(app, access_log=False, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=int(settings.timeout) + 5)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; with Python's default handler
    # SIGTERM would then kill the process (status 143). This handler makes a drained stop exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # The graphs all-reduce with every rank: without one, no image can be made. Say so at once to /health
    # and the waiting requests, stop, and exit non-zero (the parent names the rank).
    signal.signal(PEER_DIED, lambda *_: app.state.fail("a tensor-parallel rank has exited"))
    h, p = sock.getsockname()[:2]
    print(f"qic serve: listening on http://{h}:{p}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        failed = app.state.scheduler.failed
        if failed is None:   # release the other ranks; out of step, they would never take the message
            runner.close()
    if failed is not None:
        raise QicError(f"stopped: {failed}")
    log.info("stopped")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}", "pick another --port or --host") from None
    return sock


def _log_to_stderr() -> None:
    """Our lines and uvicorn's, one per line on stderr; access lines are JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("qic.serve", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
