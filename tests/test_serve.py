"""Issue 9: `qic serve`, the OpenAI images API over a bundle.

Tests named *fake_runner* drive the HTTP app and the queue with FakeRunner, a stand-in for the bundle
that records what it was asked to run (it makes no images): they cover batching, which needs graphs
for batch sizes above 1 that no bundle has yet, and timing-dependent paths (disconnect, timeout).
The other tests serve the session bundle through the `qic serve` command.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from PIL import Image

from qic.errors import ConfigError
from qic.serve.queue import Job, take_group
from tests.conftest import QIC, ROOT, TINY_RES, qic

SIZE = "{1}x{0}".format(*TINY_RES)   # OpenAI's WIDTHxHEIGHT
STEPS = 2


# ------------------------------------------------------------------------------------------ helpers

def request(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60):
    """(status, headers, parsed JSON body) over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(payload) if payload else None
    finally:
        conn.close()


def png_of(body: dict, i: int = 0) -> bytes:
    return base64.b64decode(body["data"][i]["b64_json"])


class FakeRunner:
    """Stands in for BundleRunner: items are dicts carrying their own batch key; run() records each
    batch and returns a marker per item. `gate` holds run() until the test opens it."""

    model_id = "fake"
    created = 0
    sizes = {SIZE: TINY_RES}

    def __init__(self, batch_sizes=(1,), seconds: float = 0.0):
        self.batch_sizes = batch_sizes
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.seconds = seconds

    def plan(self, req):
        if req.prompt == "too long":
            raise ConfigError("prompt is 999 tokens with the template; the model takes at most 128")
        return (req.steps,)

    def run(self, reqs):
        self.started.set()
        self.gate.wait(30)
        time.sleep(self.seconds)
        self.batches.append([r.seed for r in reqs])
        return [f"seed {r.seed}".encode() for r in reqs]


class ThreadServer:
    """The app on uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, runner, **settings):
        import uvicorn

        from qic.serve.app import Settings, create_app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(create_app(runner, Settings(**settings)), access_log=False, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


# --------------------------------------------------------------------- queue and batching (fakes)

def test_take_group_batches_compatible_jobs_in_sizes_the_bundle_has():
    def jobs(keys):
        return [Job(i, k, None) for i, k in enumerate(keys)]
    pending = jobs("aabaaab")
    # sizes 1, 2, 4: five "a" jobs -> a batch of 4 (oldest first), then the "b"s in a batch of 2, then the last a.
    assert [j.item for j in take_group(pending, (2, 4))] == [0, 1, 3, 4]
    assert [j.item for j in take_group(pending, (2, 4))] == [2, 6]
    assert [j.item for j in take_group(pending, (2, 4))] == [5]
    assert pending == [] and take_group(pending, (2, 4)) == []
    # Bundles today have batch-1 graphs only: one job at a time, in arrival order.
    pending = jobs("aab")
    assert [[j.item for j in take_group(pending, (1,))] for _ in range(3)] == [[0], [1], [2]]
    # Three compatible jobs and sizes 1, 2, 4: a batch of 2, never 4 with a padded row.
    pending = jobs("aaa")
    assert len(take_group(pending, (1, 2, 4))) == 2


def test_fake_runner_gets_compatible_requests_batched_over_http():
    runner = FakeRunner(batch_sizes=(1, 2, 4))
    runner.gate.clear()
    with ThreadServer(runner, queue=16, max_batch=4) as srv, ThreadPoolExecutor(8) as pool:
        first = pool.submit(request, srv.port, "POST", "/v1/images/generations",
                            {"prompt": "x", "seed": 100, "steps": 3})
        assert runner.started.wait(10)
        # While the first runs: three images at steps 2 (one request, n=3), then two at steps 5.
        scheduler = srv.server.config.app.state.scheduler
        futs = []
        for body, queued in (({"prompt": "x", "n": 3, "seed": 0, "steps": 2}, 3),
                             ({"prompt": "x", "n": 2, "seed": 10, "steps": 5}, 5)):
            futs.append(pool.submit(request, srv.port, "POST", "/v1/images/generations", body))
            deadline = time.monotonic() + 10
            while len(scheduler.pending) < queued:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        runner.gate.set()
        results = [f.result() for f in [first, *futs]]
    assert [s for s, _, _ in results] == [200, 200, 200]
    # Batches of 2 (the largest size the compatible jobs fill), the oldest job always first: seed 2
    # runs alone before the steps-5 pair rather than waiting behind it.
    assert runner.batches == [[100], [0, 1], [2], [10, 11]]
    assert [base64.b64decode(d["b64_json"]) for d in results[1][2]["data"]] == [b"seed 0", b"seed 1", b"seed 2"]


def test_fake_runner_client_disconnect_cancels_queued_work():
    runner = FakeRunner()
    runner.gate.clear()
    with ThreadServer(runner) as srv, ThreadPoolExecutor(2) as pool:
        first = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 1})
        assert runner.started.wait(10)
        # A second client queues an image and hangs up before it runs.
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("POST", "/v1/images/generations", body=json.dumps({"prompt": "x", "seed": 2}),
                     headers={"Content-Type": "application/json"})
        scheduler = srv.server.config.app.state.scheduler
        deadline = time.monotonic() + 10
        while len(scheduler.pending) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        while len(scheduler.pending) > 0:
            assert time.monotonic() < deadline, "the queued job was not cancelled"
            time.sleep(0.02)
        runner.gate.set()
        assert first.result()[0] == 200
    assert runner.batches == [[1]]   # seed 2 never ran


def test_fake_runner_queue_full_is_429_with_retry_after_and_timeout_is_504():
    runner = FakeRunner()
    runner.gate.clear()
    with ThreadServer(runner, queue=1, timeout=1.0) as srv, ThreadPoolExecutor(2) as pool:
        first = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 1})
        assert runner.started.wait(10)
        queued = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 2})
        time.sleep(0.3)
        status, headers, body = request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 3})
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body["error"]["code"] == "rate_limit_exceeded"
        # Nothing finishes within the 1 s timeout while the gate is shut: both waiting requests get 504.
        for f in (first, queued):
            status, _, body = f.result()
            assert status == 504 and body["error"]["type"] == "timeout_error"
        runner.gate.set()
        assert request(srv.port, "GET", "/health")[0] == 200
    assert runner.batches == [[1]]   # the queued seed-2 job was dropped at its timeout
