"""The tests' side of tests/zygote.py: one zygote per pytest process, started on first use, and `run`, which
gives what `subprocess.run(argv, capture_output=True, text=True)` gives for a `python -m qic.cli` argv."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.zygote import IMPORT_TIME_ENV

_lock = threading.Lock()
_state: dict = {}   # proc, path, env: the running zygote, its socket, the environment it imported under


def _import_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _zygote() -> dict:
    with _lock:
        proc = _state.get("proc")
        if proc is None or proc.poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="qic-zygote-"))
            path = str(folder / "socket")
            proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), path],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"tests/zygote.py did not start (exit {proc.wait()})")
            _state.update(proc=proc, path=path, folder=folder, env=_import_time(dict(os.environ)))
            if not _state.get("registered"):
                atexit.register(_stop)
                _state["registered"] = True
        return dict(_state)


def _stop() -> None:
    proc = _state.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def forkable(env: dict) -> bool:
    """A run under `env` can be a fork of the zygote: nothing read at its imports differs."""
    return _import_time(env) == (_state["env"] if _state.get("proc") else _import_time(dict(os.environ)))


def run(argv: list[str], env: dict, cwd, timeout: float | None = None) -> subprocess.CompletedProcess:
    """argv: [python, "-m", "qic.cli", ARGS...] (the args after the module are the run's)."""
    from tests.tiers import count_process
    state = _zygote()
    count_process()
    with tempfile.TemporaryDirectory(dir=state["folder"]) as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(state["path"])
            conn.sendall((json.dumps({"argv": argv[3:], "env": env, "cwd": str(cwd), "stdout": str(out),
                                      "stderr": str(err)}) + "\n").encode())
            replies = conn.makefile("r")
            pid = int(replies.readline())
            conn.settimeout(timeout)
            try:
                line = replies.readline()
            except TimeoutError:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            code = int(line)
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
