"""The tests' side of tests/zygote.py: a zygote per pytest process, interpreter and import-time environment,
started on first use; `run`, which gives what `subprocess.run(argv, capture_output=True, text=True)` gives for a
`python -m MODULE ARGS` argv, and `Popen`, for such a run that goes on in the background (a server)."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from tests.zygote import IMPORT_TIME_ENV

_lock = threading.Lock()
_zygotes: dict = {}   # (python, import-time environment) -> {proc, path, folder}


def _import_time(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))


def _zygote(python: str, env: dict) -> dict:
    key = (python, _import_time(env))
    with _lock:
        z = _zygotes.get(key)
        if z is None or z["proc"].poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="qic-zygote-"))
            path = str(folder / "socket")
            proc = subprocess.Popen([python, str(Path(__file__).with_name("zygote.py")), path], env=env,
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"tests/zygote.py did not start under {python} (exit {proc.wait()})")
            if not _zygotes:
                atexit.register(_stop)
            z = _zygotes[key] = {"proc": proc, "path": path, "folder": folder}
        return z


def _stop() -> None:
    for z in _zygotes.values():
        if z["proc"].poll() is None:
            z["proc"].kill()
            z["proc"].wait()
        shutil.rmtree(z["folder"], ignore_errors=True)   # its socket (the runs' stream files are gone already)


def forkable(argv: list[str], overrides: dict | None = None, **kw) -> bool:
    """`subprocess.run(argv, **kw)` with these environment overrides can be a fork of a zygote: `python -m MODULE
    ...`, nothing asked of it but a timeout, no interpreter option in the environment but PYTHONPATH (a zygote is
    started with it), and few zygotes of other import-time environments running."""
    options = [k for k in overrides or {} if k.startswith("PYTHON") and k != "PYTHONPATH"]
    return len(argv) >= 3 and argv[1] == "-m" and set(kw) <= {"timeout"} and not options and len(_zygotes) < 4


class Popen:
    """A `python -m MODULE ARGS` fork of the zygote that runs on in the background (a server): what subprocess.Popen
    gives for it (pid, poll, wait, send_signal, terminate, kill, returncode), its standard streams written to the
    files `stdout` and `stderr`. The run is the zygote's grandchild, so its exit status comes over the connection."""

    def __init__(self, argv: list[str], env: dict, cwd, stdout: Path, stderr: Path, start_new_session: bool = False):
        from tests.tiers import count_process
        z = _zygote(argv[0], env)
        count_process()
        self.args, self.returncode = argv, None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(z["path"])
        self._conn.sendall((json.dumps({"module": argv[2], "args": argv[3:], "env": env, "cwd": str(cwd),
                                        "stdout": str(stdout), "stderr": str(stderr),
                                        "new_session": start_new_session}) + "\n").encode())
        # Unbuffered: a read must not take the exit line along with the pid line, or select() below would not see it.
        self._replies = self._conn.makefile("rb", buffering=0)
        self.pid = int(self._replies.readline())

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(self._replies.readline())   # the runner writes the line whole
            self._replies.close()
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(argv: list[str], env: dict, cwd, stdout: Path, stderr: Path, start_new_session: bool = False):
    """A Popen of `argv` with its streams written to the files `stdout` and `stderr`: a fork of the zygote where
    `forkable`, else a subprocess."""
    if forkable(argv):
        return Popen(argv, env, cwd, stdout, stderr, start_new_session)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=start_new_session)


def run(argv: list[str], env: dict, cwd, timeout: float | None = None) -> subprocess.CompletedProcess:
    """argv: [python, "-m", MODULE, ARGS...]; what subprocess.run(argv, capture_output=True, text=True, env=env,
    cwd=cwd, timeout=timeout) returns, from a fork of the zygote of that python and environment."""
    with tempfile.TemporaryDirectory(dir=_zygote(argv[0], env)["folder"]) as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = Popen(argv, env, cwd, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
