"""A started Python that has imported torch and forks `python -m MODULE ARGS` runs for the tests (test-only).

Why: a `qic` process spends about 1.3 s of CPU starting the interpreter and importing torch before it does
anything, and the suite runs a few hundred of them on two cores. A zygote pays that once per pytest process and
interpreter (the lowering environment's python has one of its own): each run is a fork of it, so a test still
gets a process of its own, with its own arguments, environment, working directory, standard streams, exit status
and interpreter shutdown, as `subprocess.run` gives it.

What the fork shares with the zygote is only what `import torch` (and numpy, PIL, safetensors and the parts of
torch in PRELOAD) did, so nothing read at those imports may differ per run: a zygote is started per import-time
environment (PYTHONPATH, OMP_*, MKL_*, KMP_*, TORCH*, LD_*, inductor's and the C++ compiler's: tests/zygote_client.py
keys them), and a run asking for an interpreter option (PYTHONPROFILEIMPORTTIME and the like) is a plain subprocess.
The zygote never runs a torch operator, so no OpenMP thread pool exists to be broken by the fork.

Protocol (one Unix-socket connection a run): the client sends one JSON line {module, args, env, cwd, stdout, stderr,
new_session} (stdout, stderr: files the run writes its streams to; new_session: start it in a session of its own);
the zygote forks a runner for the connection, which forks the run and answers two lines, the run's pid and then its
exit status as subprocess reports it (-N: signal N).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

# Those an environment lacks are skipped. Beyond torch itself, the parts of it a build imports (torch.export,
# dynamo, inductor, torch.distributed, sympy): about 2 s of a core that every `qic build` and every run of an
# export bundle would pay again (measured with -X importtime); importing them runs no operator and starts no
# thread. torch_xla (the lowering environment's zygote only): 2.4 s more of every neuron build and XLA:CPU run; its
# import starts no thread either (the PJRT client is made at the first device use, in the run). The runtime's own
# imports are checked in fresh interpreters (tests/test_run.py, tests/test_serve.py).
PRELOAD = ("torch", "numpy", "PIL.Image", "safetensors.torch", "torch.distributed", "torch.export", "torch._dynamo",
           "torch._inductor.compile_fx", "torch._inductor.package", "sympy", "torch_xla")
# Environment variables read while those modules import (or at interpreter start): a zygote serves runs whose
# values of these are its own (inductor's config reads TORCHINDUCTOR_*, AOT_INDUCTOR_* and CXX at import; torch_xla
# reads PJRT_*, XLA_* and the Neuron runtime's NEURON_*).
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "LD_", "GOMP_", "AOT_INDUCTOR", "AOTINDUCTOR",
                   "INDUCTOR_", "PT2_", "CXX", "CC", "PJRT_", "XLA_", "NEURON")
# The file each run's cost is appended to (tests/tiers.py sets it for the whole run and sums it at the end).
RUN_LOG = "QIC_TEST_RUNLOG"


def _run(request: dict) -> None:
    """In the forked run: become `python -m MODULE ARGS` and exit as it would. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request.get("new_session"):   # as subprocess's start_new_session: a process group to kill whole
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    import runpy
    sys.argv = ["-m", *request["args"]]   # runpy puts the module's path in argv[0], as `python -m` does
    sys.path[0] = os.getcwd()             # `python -m` puts the working directory first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)   # the CLI returned: exit through the interpreter's shutdown, as `python -m` does


def _log_cost(request: dict, usage, wall: float) -> None:
    """One JSON line for the run in the file $QIC_TEST_RUNLOG names (tests/tiers.py sums them): the test that asked,
    what ran, its CPU seconds (its own and its waited-for children's: a build's C++ compiler, a run's ranks) and wall
    seconds. One write of an O_APPEND file: lines of runs ending together do not interleave."""
    path = request["env"].get(RUN_LOG)
    if not path:
        return
    args = request["args"]
    line = json.dumps({"test": request["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                       "run": " ".join([request["module"], *args[:1]] if request["module"] == "qic.cli"
                                       else [request["module"]]),
                       "cpu": round(usage.ru_utime + usage.ru_stime, 2), "wall": round(wall, 2)})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _runner(conn: socket.socket) -> None:
    """In the forked runner of one connection: fork the run, report its pid and its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request = json.loads(conn.makefile("r").readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request)
    conn.sendall(f"{pid}\n".encode())
    start = time.monotonic()
    _, status, usage = os.wait4(pid, 0)
    _log_cost(request, usage, time.monotonic() - start)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    conn.close()
    os._exit(0)


def serve(path: str) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # runners are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(5)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:   # the test process is gone (killed without its atexit): so is the zygote
                return
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            server.close()
            _runner(conn)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
