"""`qic serve BUNDLE`: check, load once, bind, then serve until SIGTERM or Ctrl-C drains it."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from pathlib import Path

from qic.errors import ConfigError
from qic.manifest import read_manifest


def run_serve(bundle_path: str, host: str, port: int, tp: int | None, settings) -> None:
    built_tp = read_manifest(Path(bundle_path))["tp"]
    if tp is not None and tp != built_tp:
        raise ConfigError(f"--tp {tp} asked for, but the bundle was built for tp={built_tp}",
                          f"serve with --tp {built_tp} or rebuild with --tp {tp}")
    if built_tp != 1:
        raise ConfigError(f"qic serve runs tp=1 bundles only; {bundle_path} was built for tp={built_tp}",
                          f"serve a tp=1 build, or use `qic run --tp {built_tp} --prompts-file`")
    for name in ("queue", "max_n", "max_batch"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not settings.timeout > 0:
        raise ConfigError("--timeout must be a positive number of seconds")
    # Binding before loading makes a taken port a one-line error rather than a wasted load.
    sock = _bind(host, port)

    import uvicorn

    from qic.runtime.bundle import Bundle
    from qic.serve.app import create_app
    from qic.serve.runner import BundleRunner

    _log_to_stderr()
    log = logging.getLogger("qic.serve")
    t = time.perf_counter()
    runner = BundleRunner(Bundle(bundle_path))
    log.info(f"loaded {bundle_path} ({runner.model_id}, sizes {', '.join(runner.sizes)}) in "
             f"{time.perf_counter() - t:.2f} s; batch sizes: bundle {list(runner.bundle_batch_sizes)}, "
             f"run {list(runner.batch_sizes)}")
    app = create_app(runner, settings)
    # In-flight and queued requests get the request timeout to finish after SIGTERM, then are cut.
    config = uvicorn.Config(app, access_log=False, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=int(settings.timeout) + 5)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; with Python's default handler
    # SIGTERM would then kill the process (status 143). This handler makes a drained stop exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    h, p = sock.getsockname()[:2]
    print(f"qic serve: listening on http://{h}:{p}", flush=True)
    server.run(sockets=[sock])
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
    sock.set_inheritable(True)
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
