"""Issue 9: `qic serve`, the OpenAI images API over a bundle.

Tests named *fake_runner* drive the HTTP app and the queue with FakeRunner, a stand-in for the bundle
that records what it was asked to run (it makes no images): they cover the queue's grouping and
timing-dependent paths (disconnect, timeout). The other tests serve the session bundle through the
`qic serve` command; a real bundle with batched graphs is served in tests/test_batching.py.
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
from pathlib import Path

import psutil
import pytest
from PIL import Image

from qic.errors import ConfigError
from qic.runtime import generate as generate_program
from qic.serve.client import request
from qic.serve.queue import Job, take_group
from tests import zygote_client as zygote
from tests.conftest import BUCKETS, QIC, ROOT, TINY_RES, qic
from tests.helpers import assert_die_with, rewritten_bundle

pytestmark = pytest.mark.slow   # starts servers over compiled bundles

SIZE = "{1}x{0}".format(*TINY_RES)   # OpenAI's WIDTHxHEIGHT
STEPS = 2


# ------------------------------------------------------------------------------------------ helpers

def png_of(body: dict, i: int = 0) -> bytes:
    return base64.b64decode(body["data"][i]["b64_json"])


class FakeRunner:
    """Stands in for BundleRunner: items are dicts carrying their own batch key; run() records each
    batch and returns a marker per item. `gate` holds run() until the test opens it."""

    model_id = "fake"
    created = 0
    sizes = {SIZE: TINY_RES}
    program = generate_program   # the text-to-image program: its Request is what the HTTP fields make

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


def scrape(port: int) -> dict:
    """GET /metrics, parsed by prometheus-client's own parser: {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    status, headers, text = request(port, "GET", "/metrics", timeout=30)
    assert status == 200 and headers["content-type"].startswith("text/plain"), (status, headers)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def until(condition, deadline: float, what: str) -> None:
    """Poll `condition` every 20 ms; fail with `what` once time.monotonic() passes `deadline`."""
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class ThreadServer:
    """The app on uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, runner, on_fail=None, warm_up=None, **settings):
        import uvicorn

        from qic.serve.app import Settings, create_app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.app = create_app(runner, Settings(**settings), on_fail=on_fail, warm_up=warm_up)
        config = uvicorn.Config(self.app, access_log=False, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        until(lambda: self.server.started, time.monotonic() + 10, "server did not start")
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
            until(lambda: len(scheduler.pending) >= queued, time.monotonic() + 10, f"{queued} images not queued")
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
        until(lambda: len(scheduler.pending) >= 1, deadline, "the second request was not queued")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        until(lambda: len(scheduler.pending) == 0, deadline, "the queued job was not cancelled")
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
        # Until the second request is queued (a fixed sleep raced it on a loaded machine): then the queue is full.
        scheduler = srv.server.config.app.state.scheduler
        until(lambda: len(scheduler.pending) >= 1, time.monotonic() + 10, "the second request was not queued")
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


def test_fake_runner_n_larger_than_the_queue_is_400_not_a_permanent_429():
    # Before, the request was refused as "queue full" (429, retry after ...) however long it retried.
    with ThreadServer(FakeRunner(), queue=2, max_n=4) as srv:
        status, headers, body = request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "n": 4})
        assert status == 400 and "retry-after" not in headers, body
        assert body["error"]["param"] == "n" and "--queue 2" in body["error"]["message"], body
        assert request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "n": 2})[0] == 200


def test_fake_runner_fail_answers_503_to_health_and_every_waiting_request():
    """app.state.fail (what `qic serve --tp N` calls when a rank dies): the running and the queued request
    get 503 at once, not when the stuck batch gives up; so do later ones; /health turns 503 with the reason."""
    runner = FakeRunner()
    runner.gate.clear()
    failed = []
    with ThreadServer(runner, on_fail=failed.append) as srv, ThreadPoolExecutor(2) as pool:
        running = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 1})
        assert runner.started.wait(10)
        queued = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 2})
        scheduler = srv.app.state.scheduler
        until(lambda: len(scheduler.pending) >= 1, time.monotonic() + 10, "the second request was not queued")
        srv.app.state.fail("rank 1 has exited")   # from this thread, as a signal handler would
        for f in (running, queued):
            status, _, body = f.result(timeout=10)
            assert status == 503 and "rank 1 has exited" in body["error"]["message"], body
        status, _, health = request(srv.port, "GET", "/health")
        assert status == 503 and health["status"] == "unavailable" and health["reason"] == "rank 1 has exited"
        assert request(srv.port, "POST", "/v1/images/generations", {"prompt": "x"})[0] == 503
        runner.gate.set()
    assert [str(e) for e in failed] == ["rank 1 has exited"]


class TimedFakeRunner(FakeRunner):
    """FakeRunner whose batches go through two graphs of a stand-in bundle, timed by the server's StageClock as a
    real bundle's are: "text_encoder" once a batch (10 ms) and "denoiser" once an image (20 ms each)."""

    def __init__(self, **kw):
        from qic.runtime.bundle import Graph
        from qic.serve.metrics import StageClock
        super().__init__(**kw)

        def sleeps(seconds):
            return lambda tensors: time.sleep(seconds) or []
        self.bundle = type("StandIn", (), {})()
        self.bundle.graphs = {("text_encoder", "t"): Graph("t", sleeps(0.01), []),
                              ("denoiser", "d"): Graph("d", sleeps(0.02), [])}
        self.stage_clock = StageClock(self.bundle)

    def run(self, reqs):
        self.bundle.graphs["text_encoder", "t"]()
        for _ in reqs:
            self.bundle.graphs["denoiser", "d"]()
        return super().run(reqs)


def test_fake_runner_metrics_count_requests_images_batches_stages_and_the_queue():
    """GET /metrics (Prometheus text, read back with prometheus-client's parser): requests by path and status
    (an unknown path counted as "other"), images, batch sizes, seconds by stage as the graphs ran them, and the
    queue depth while a request waits."""
    runner = TimedFakeRunner(batch_sizes=(1, 2))
    with ThreadServer(runner, max_batch=2) as srv, ThreadPoolExecutor(2) as pool:
        assert request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "n": 2})[0] == 200   # a batch of 2
        assert request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 5})[0] == 200  # and of 1
        assert request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", "steps": "2"})[0] == 400
        assert request(srv.port, "GET", "/no/such/path")[0] == 404
        runner.gate.clear()
        runner.started.clear()
        running = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 7})
        assert runner.started.wait(10)
        queued = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 8})
        until(lambda: len(srv.app.state.scheduler.pending) == 1, time.monotonic() + 10, "not queued")
        m = scrape(srv.port)
        assert m["qic_queue_depth", ()] == 1 and m["qic_images_running", ()] == 1, m
        runner.gate.set()
        assert running.result(10)[0] == queued.result(10)[0] == 200
        m = scrape(srv.port)
    gens = "/v1/images/generations"
    assert m["qic_requests_total", (("path", gens), ("status", "200"))] == 4
    assert m["qic_requests_total", (("path", gens), ("status", "400"))] == 1
    assert m["qic_requests_total", (("path", "other"), ("status", "404"))] == 1
    assert m["qic_requests_total", (("path", "/metrics"), ("status", "200"))] == 1   # the first scrape
    assert m["qic_images_total", (("outcome", "ok"),)] == 5 and m["qic_images_total", (("outcome", "error"),)] == 0
    assert m["qic_batch_size_count", ()] == 4 and m["qic_batch_size_sum", ()] == 5     # batches of 2, 1, 1, 1
    assert m["qic_batch_size_bucket", (("le", "1.0"),)] == 3
    for stage, calls, each in (("text_encoder", 4, 0.01), ("denoiser", 5, 0.02)):
        assert m["qic_stage_seconds_count", (("stage", stage),)] == 4, m   # one observation a batch
        assert m["qic_stage_seconds_sum", (("stage", stage),)] >= calls * each, (stage, m)
    assert m["qic_batch_seconds_sum", ()] >= 4 * 0.01 + 5 * 0.02
    assert m["process_resident_memory_bytes", ()] > 2**20


def test_fake_runner_health_is_live_at_once_and_ready_once_warmed_then_neither_after_a_failure():
    """qic serve opens its port before the warm-up: /health/live answers 200 from the start, /health and
    /health/ready 503 "warming" until the warm-up has run, and a request sent meanwhile waits in the queue (not
    running) and is made after it; after app.state.fail, all three answer 503."""
    warming = threading.Event()
    runner = FakeRunner()
    with ThreadServer(runner, warm_up=lambda: warming.wait(30)) as srv, ThreadPoolExecutor(1) as pool:
        status, _, body = request(srv.port, "GET", "/health/live")
        assert status == 200 and body["live"] and not body["ready"], body
        for path in ("/health", "/health/ready"):
            status, _, body = request(srv.port, "GET", path)
            assert status == 503 and body["status"] == "warming" and not body["ready"], body
        early = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x", "seed": 4})
        until(lambda: len(srv.app.state.scheduler.pending) == 1, time.monotonic() + 10, "not queued")
        assert srv.app.state.scheduler.running == 0 and runner.batches == []
        warming.set()
        assert early.result(10)[0] == 200 and runner.batches == [[4]]
        for path in ("/health", "/health/ready", "/health/live"):
            status, _, body = request(srv.port, "GET", path)
            assert status == 200 and body["status"] == "ok" and body["ready"] and body["live"], (path, body)
        srv.app.state.fail("rank 1 has exited")
        for path in ("/health", "/health/ready", "/health/live"):
            deadline = time.monotonic() + 10
            while (reply := request(srv.port, "GET", path))[0] != 503:   # the failure lands on the event loop
                assert time.monotonic() < deadline, (path, reply)
                time.sleep(0.02)
            assert reply[2]["status"] == "unavailable" and not reply[2]["live"], reply


def test_fake_runner_a_failed_warm_up_fails_the_waiting_request_and_runs_nothing():
    """A warm-up that raises (a graph that cannot run) leaves the server unavailable: the request waiting for it
    gets 503 naming the failure, /health 503, and no batch runs (at tp > 1 one would pair its collectives with
    nothing)."""
    warming = threading.Event()

    def broken():
        warming.wait(30)
        raise RuntimeError("graph text_encoder@L128 could not run")
    runner, failed = FakeRunner(), []
    with ThreadServer(runner, on_fail=failed.append, warm_up=broken) as srv, ThreadPoolExecutor(1) as pool:
        early = pool.submit(request, srv.port, "POST", "/v1/images/generations", {"prompt": "x"})
        until(lambda: len(srv.app.state.scheduler.pending) == 1, time.monotonic() + 10, "not queued")
        warming.set()
        status, _, body = early.result(10)
        assert status == 503 and "warming up failed: RuntimeError: graph text_encoder" in body["error"]["message"]
        status, _, health = request(srv.port, "GET", "/health")
        assert status == 503 and "warming up failed" in health["reason"], health
    assert runner.batches == [] and [str(e) for e in failed] == [health["reason"]]


# ------------------------------------------------------------------------ the real bundle, served

class ServeProcess:
    """`qic serve BUNDLE --port 0 ...` in a process of its own, forked from the test process's zygote
    (tests/zygote.py: the interpreter and torch already started, 1.3 s of CPU a server less); stderr (the access
    log) goes to `log_path`, stdout (the address line) to a file beside it."""

    def __init__(self, bundle, log_path, *args):
        self.log_path = Path(log_path)
        argv = [*QIC, "serve", str(bundle), "--port", "0", *map(str, args)]
        out = self.log_path.with_name(self.log_path.name + ".stdout")
        self.proc = zygote.popen(argv, dict(os.environ), ROOT, out, self.log_path)
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().endswith("\n")):   # the address line, written whole
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.02)
        line = out.read_text().splitlines()[0]
        assert "listening on http://127.0.0.1:" in line, (line, self.log_path.read_text())
        self.port = int(line.rsplit(":", 1)[1])
        while True:
            try:
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)

    def rss_mib(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = ServeProcess(bundle, tmp_path_factory.mktemp("serve") / "serve.log", "--queue", 4, "--max-n", 2)
    yield srv
    srv.close()
    assert srv.proc.returncode == 0, srv.log_path.read_text()


def gen(port: int, **body):
    return request(port, "POST", "/v1/images/generations", {"prompt": "a red bicycle", "steps": STEPS, **body})


def test_openai_client_gets_the_png_qic_run_writes(server, bundle, tmp_path):
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    settings = {"negative_prompt": "blurry", "steps": STEPS, "guidance": 3.5}
    resp = client.images.generate(model=model.id, prompt="a red bicycle", n=2, size=SIZE, response_format="b64_json",
                                  extra_body={"seed": 11, **settings})
    served = [base64.b64decode(d.b64_json) for d in resp.data]
    lines = "".join(json.dumps({"prompt": "a red bicycle", "seed": s, **settings}) + "\n" for s in (11, 12))
    (tmp_path / "p.jsonl").write_text(lines)
    qic("run", bundle, "--prompts-file", tmp_path / "p.jsonl", "--output", tmp_path / "img.png")
    written = [(tmp_path / f"img-{i:03d}.png").read_bytes() for i in range(2)]
    assert served[0] == written[0] and served[1] == written[1]
    assert served[0] != served[1]   # n=2 draws seeds 11 and 12: the comparison can tell images apart
    meta = Image.open(io.BytesIO(served[1])).text
    assert meta["seed"] == "12" and meta["negative_prompt"] == "blurry"
    assert meta["resolution"] == "{}x{}".format(*TINY_RES)


def diffusers_predicted_clean(root, prompt: str, seed: int, steps: int, at: list[int]) -> list:
    """The clean pictures diffusers' QwenImagePipeline's own steps predict: its latents after each step (the step-end
    callback), x0 = x_i - sigma_i (x_(i+1) - x_i) / (sigma_(i+1) - sigma_i) at each step i of `at` (>= 1: x_i is the
    latents after step i-1), decoded as the pipeline decodes its final latents."""
    import torch
    from diffusers import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    after = []

    def grab(pipe, i, t, tensors):
        after.append(tensors["latents"].clone())
        return {}
    h, w = TINY_RES
    pipe(prompt, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=steps, height=h, width=w,
         generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=grab,
         callback_on_step_end_tensor_inputs=["latents"])
    sigmas, vae = pipe.scheduler.sigmas, pipe.vae
    out = []
    with torch.no_grad():
        for i in at:
            x, x_next = after[i - 1], after[i]
            x0 = x - sigmas[i] * (x_next - x) / (sigmas[i + 1] - sigmas[i])
            latents = pipe._unpack_latents(x0, h, w, pipe.vae_scale_factor)
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
            image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
            out.append(pipe.image_processor.postprocess(image, output_type="pil")[0])
    return out


def test_streamed_partial_images_are_diffusers_predicted_pictures_and_the_completed_png_is_unstreamed(
        server, tiny_ckpt):
    """stream: true, partial_images 2, 6 steps: the partial images come after steps 1 and 3 and are the clean
    pictures diffusers' own latents predict there (within the image parity bound); each is far from the other
    step's, so the bound can tell steps apart; the completed image is the PNG the request gets unstreamed."""
    from openai import OpenAI

    from tests.conftest import image_diff
    from tests.helpers import MAX_PIXEL, MEAN_PIXEL
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    events = list(client.images.generate(prompt="a red bicycle", size=SIZE, stream=True, partial_images=2,
                                         extra_body={"seed": 21, "steps": 6}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    partials = [Image.open(io.BytesIO(base64.b64decode(e.b64_json))) for e in events[:2]]
    status, _, body = gen(server.port, seed=21, steps=6)
    assert status == 200 and base64.b64decode(events[2].b64_json) == png_of(body)
    reference = diffusers_predicted_clean(tiny_ckpt, "a red bicycle", 21, 6, [1, 3])
    for ours, theirs in zip(partials, reference):
        worst, mean = image_diff(ours, theirs)
        assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    assert image_diff(partials[0], reference[1])[1] > 1 and image_diff(partials[1], reference[0])[1] > 1


def test_burst_of_50_gets_images_or_429_and_memory_settles(server):
    assert gen(server.port, seed=999)[0] == 200   # warm: the first run's allocations are part of "loaded"
    post_load = server.rss_mib()
    seeds = list(range(1000, 1050))
    t = time.perf_counter()
    with ThreadPoolExecutor(len(seeds)) as pool:
        results = list(pool.map(lambda s: gen(server.port, seed=s), seeds))
    burst_s = time.perf_counter() - t
    served = []
    for seed, (status, headers, body) in zip(seeds, results):
        assert status in (200, 429), (status, body)
        if status == 429:
            assert int(headers["retry-after"]) >= 1 and body["error"]["type"] == "rate_limit_error"
        else:
            assert len(body["data"]) == 1
            served.append(int(Image.open(io.BytesIO(png_of(body))).text["seed"]))
    ok = [s for s, (status, _, _) in zip(seeds, results) if status == 200]
    assert served == ok   # every image is the one its request asked for: none lost, none duplicated
    assert 0 < len(ok) < len(seeds)   # a queue of 4 both serves and refuses in a burst of 50
    time.sleep(1.0)
    after = server.rss_mib()
    print(f"burst of {len(seeds)} in {burst_s:.2f} s: {len(ok)} images, {len(seeds) - len(ok)} x 429; "
          f"RSS post-load {post_load:.0f} MiB, after the burst {after:.0f} MiB ({after / post_load - 1:+.1%})")
    assert request(server.port, "GET", "/health")[0] == 200
    assert after <= 1.10 * post_load


def test_int_guidance_gives_the_png_bytes_of_qic_run(server, bundle, tmp_path):
    """JSON `"guidance": 4` in a request and in a prompts-file line is one setting: the same PNG bytes, its
    text chunk "4.0" as --guidance 4 writes. Before, run wrote the int as "4" and serve the float as "4.0"."""
    settings = {"prompt": "a red bicycle", "steps": STEPS, "guidance": 4, "seed": 21}
    status, _, body = request(server.port, "POST", "/v1/images/generations", settings)
    assert status == 200, body
    (tmp_path / "p.jsonl").write_text(json.dumps(settings) + "\n")
    qic("run", bundle, "--prompts-file", tmp_path / "p.jsonl", "--output", tmp_path / "img.png")
    written = (tmp_path / "img-000.png").read_bytes()
    assert Image.open(io.BytesIO(written)).text["guidance"] == "4.0"
    assert png_of(body) == written


@pytest.fixture(scope="module")
def nocfg_bundle(bundle, workdir, cache_dir, tiny_ckpt):
    """A Lightning-style bundle: run defaults of 8 steps and guidance 1 (an int, as a config writes it),
    only the no-CFG step graph. Bucket 72 like tests/test_nocfg.py's, so one of the two compiles it."""
    config = workdir / "serve-nocfg.yaml"
    config.write_text(json.dumps({
        "model": str(tiny_ckpt), "resolutions": ["{}x{}".format(*TINY_RES)], "text_buckets": BUCKETS[0],
        "cfg": False, "defaults": {"steps": 8, "guidance": 1},
        "cache_dir": str(cache_dir), "output": str(workdir / "bundle-serve-nocfg")}))
    qic("build", config)
    return workdir / "bundle-serve-nocfg"


def test_request_without_steps_or_guidance_gets_qic_runs_defaults(nocfg_bundle, tmp_path):
    """Before, the API's own defaults (20 steps, guidance 4) applied: true CFG, which this bundle has no
    graph for, so the request failed instead of giving `qic run`'s image."""
    srv = ServeProcess(nocfg_bundle, tmp_path / "serve.log")
    try:
        status, _, body = request(srv.port, "POST", "/v1/images/generations", {"prompt": "a red bicycle", "seed": 3})
        # True CFG, which the bundle has no graph for, is refused when the request is checked (it was a 500).
        cfg_status, _, cfg_body = request(srv.port, "POST", "/v1/images/generations",
                                          {"prompt": "a red bicycle", "guidance": 4.0})
    finally:
        srv.close()
    assert status == 200, (body, srv.log_path.read_text())
    assert cfg_status == 400 and "asks for true CFG" in cfg_body["error"]["message"], cfg_body
    qic("run", nocfg_bundle, "--prompt", "a red bicycle", "--seed", 3, "--output", tmp_path / "run.png")
    assert png_of(body) == (tmp_path / "run.png").read_bytes()
    meta = Image.open(io.BytesIO(png_of(body))).text
    assert (meta["steps"], meta["guidance"]) == ("8", "1.0")


BAD_REQUESTS = {
    "not_json": (b"{prompt: 'a cat'", None),
    "json_not_an_object": (b'["a cat"]', None),
    "no_prompt": ({"n": 1}, "prompt"),
    "empty_prompt": ({"prompt": ""}, "prompt"),
    "prompt_not_a_string": ({"prompt": 42}, "prompt"),
    "prompt_too_long": ({"prompt": "a red bicycle " * 200}, "prompt"),
    "n_too_large": ({"prompt": "a cat", "n": 3}, "n"),
    "n_zero": ({"prompt": "a cat", "n": 0}, "n"),
    "n_a_string": ({"prompt": "a cat", "n": "2"}, "n"),
    "unknown_size": ({"prompt": "a cat", "size": "1024x1024"}, "size"),
    "size_not_a_size": ({"prompt": "a cat", "size": "big"}, "size"),
    "response_format_url": ({"prompt": "a cat", "response_format": "url"}, "response_format"),
    "steps_zero": ({"prompt": "a cat", "steps": 0}, "steps"),
    "steps_a_float": ({"prompt": "a cat", "steps": 2.5}, "steps"),
    "guidance_a_string": ({"prompt": "a cat", "guidance": "high"}, "guidance"),
    "seed_negative": ({"prompt": "a cat", "seed": -1}, "seed"),
    "unknown_key": ({"prompt": "a cat", "quality": "hd"}, "quality"),
    "wrong_model": ({"prompt": "a cat", "model": "dall-e-3"}, "model"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=str)
def test_bad_request_is_400_in_openai_shape(server, case):
    body, param = BAD_REQUESTS[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, reply = request(server.port, "POST", "/v1/images/generations", raw=raw)
    assert status == 400, reply
    err = reply["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
    print(f"{case}: {err['message']}")


def test_health_models_and_access_log(server):
    # Its own image request: run alone, no other test has made one on this server.
    assert gen(server.port, seed=11)[0] == 200
    status, _, health = request(server.port, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    status, _, models = request(server.port, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == health["model"]
    assert request(server.port, "GET", "/v1/nothing")[0] == 404
    deadline = time.monotonic() + 10   # a request's line is written once its response has been sent
    while True:
        records = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
        images = [r for r in records if r["path"] == "/v1/images/generations" and r["status"] == 200]
        logged = any(r.get("seed") == 11 for r in images) and {"/health", "/v1/models", "/v1/nothing"} <= {
            r["path"] for r in records}
        if logged or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert logged, records
    assert all(r["total_s"] >= r["run_s"] > 0 and r["queue_s"] >= 0 for r in images)
    assert [r["status"] for r in records if r["path"] == "/v1/nothing"][-1] == 404
    # /metrics of the real bundle: the image's stages are the components of the graphs it ran, timed.
    m = scrape(server.port)
    for stage in ("text_encoder", "denoiser", "vae_decoder"):
        assert m["qic_stage_seconds_count", (("stage", stage),)] >= 1 and \
            m["qic_stage_seconds_sum", (("stage", stage),)] > 0, (stage, m)
    assert m["qic_images_total", (("outcome", "ok"),)] >= 1 and m["process_resident_memory_bytes", ()] > 2**20
    for path in ("/health/live", "/health/ready"):
        status, _, body = request(server.port, "GET", path)
        assert status == 200 and body["live"] and body["ready"], (path, body)


def test_sigterm_finishes_the_request_in_flight_and_exits_0(bundle, tmp_path):
    srv = ServeProcess(bundle, tmp_path / "serve.log")
    try:
        with ThreadPoolExecutor(1) as pool:
            # Enough steps that the image is still being made when the signal arrives.
            slow = pool.submit(gen, srv.port, seed=5, steps=30)
            deadline = time.monotonic() + 30
            while request(srv.port, "GET", "/health")[2]["running"] == 0:
                assert time.monotonic() < deadline and not slow.done()
                time.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            status, _, body = slow.result(timeout=120)
        assert status == 200 and Image.open(io.BytesIO(png_of(body))).text["steps"] == "30"
        assert srv.proc.wait(60) == 0, srv.log_path.read_text()
    finally:
        srv.close()


def test_tp2_server_matches_qic_run_and_stops_all_ranks_on_sigterm(bundle_tp2, tmp_path):
    # A named weight set (a FAKE other bundle: both ranks' denoiser weights x 1.05): each rank maps it, and a
    # request for it draws `qic run --tp 2 --weights`'s PNG.
    other = rewritten_bundle(bundle_tp2, tmp_path / "other", "denoiser",
                             lambda sd: {k: v * 1.05 for k, v in sd.items()})
    srv = ServeProcess(bundle_tp2, tmp_path / "serve.log", "--tp", 2, "--weights", f"x105={other}")
    try:
        ranks = psutil.Process(srv.proc.pid).children()
        assert len(ranks) >= 2   # the spawned ranks (and multiprocessing's helper, if any)
        status, _, body = gen(srv.port, seed=4)
        assert status == 200
        qic("run", bundle_tp2, "--tp", 2, "--prompt", "a red bicycle", "--steps", STEPS, "--seed", 4,
            "--output", tmp_path / "run.png")
        assert png_of(body) == (tmp_path / "run.png").read_bytes()
        # Streamed at TP 2: rank 0 alone decodes the partial image (the decoder has no collectives); the other
        # rank runs the same steps without it, and the completed image is the same PNG.
        status, _, text = request(srv.port, "POST", "/v1/images/generations", {
            "prompt": "a red bicycle", "steps": STEPS, "seed": 4, "stream": True, "partial_images": 1})
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        assert status == 200 and [e["type"] for e in events] == ["image_generation.partial_image",
                                                                 "image_generation.completed"], text[:300]
        assert base64.b64decode(events[1]["b64_json"]) == (tmp_path / "run.png").read_bytes()
        status, _, body = gen(srv.port, seed=4, model="x105")
        assert status == 200
        qic("run", bundle_tp2, "--tp", 2, "--weights", other, "--prompt", "a red bicycle", "--steps", STEPS,
            "--seed", 4, "--output", tmp_path / "x105.png")
        assert png_of(body) == (tmp_path / "x105.png").read_bytes() != (tmp_path / "run.png").read_bytes()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_path.read_text()
        psutil.wait_procs(ranks, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    finally:
        srv.close()


def _rank_waits_for_notice(rank: int, tp: int) -> bool:
    if rank == 1:
        time.sleep(2)   # rank 0 has its handler by then (the signal's default action would end it too)
        os._exit(5)     # dies without a word, as a crash would
    noticed = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: noticed.set())
    return noticed.wait(60)


def test_spawn_notify_signals_the_ranks_left_when_one_dies():
    """What `qic serve --tp N` relies on: rank 0, waiting on no collective, hears of rank 1's death at once."""
    from qic.parallel.ranks import RankFailure, spawn
    t = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(_rank_waits_for_notice, 2, timeout=None, notify=signal.SIGUSR1)
    rank0, rank1 = info.value.outcomes
    assert rank0.ok and rank0.value is True and rank1.exitcode == 5, info.value.outcomes
    assert time.monotonic() - t < 60


def tp_ranks(srv: ServeProcess) -> tuple[psutil.Process, psutil.Process]:
    """(rank 0, rank 1) of a tp=2 server: rank 0 is the child listening on the port."""
    kids = [k for k in psutil.Process(srv.proc.pid).children() if "resource_tracker" not in " ".join(k.cmdline())]
    listens = {k.pid: any(c.status == psutil.CONN_LISTEN and c.laddr.port == srv.port for c in k.net_connections("tcp"))
               for k in kids}
    [rank0] = [k for k in kids if listens[k.pid]]
    [rank1] = [k for k in kids if not listens[k.pid]]
    return rank0, rank1


def test_tp2_server_follower_death_is_503_and_a_non_zero_exit(bundle_tp2, tmp_path):
    """A dead rank makes every image impossible: the server must say so and exit for its supervisor to
    restart it. Before, /health kept answering ok and the parent waited on the ranks for a year."""
    srv = ServeProcess(bundle_tp2, tmp_path / "serve.log", "--tp", 2)
    try:
        assert gen(srv.port, seed=4)[0] == 200
        rank0, rank1 = tp_ranks(srv)
        rank1.kill()
        t = time.monotonic()
        while True:   # until /health is 503 or the port is closed (the server is stopping)
            try:
                status, _, health = request(srv.port, "GET", "/health", timeout=2)
            except OSError:
                break
            if status == 503:
                assert "rank has exited" in health["reason"], health
                break
            assert time.monotonic() - t < 10, "/health still says ok 10 s after rank 1 died"
            time.sleep(0.05)
        code = srv.proc.wait(30)
        log = srv.log_path.read_text()
        assert code != 0, log
        assert "rank 1: exited with code -9" in log and "a tensor-parallel rank has exited" in log, log
        print(f"rank 1 killed: server exited {code} after {time.monotonic() - t:.1f} s")
        psutil.wait_procs([rank0], timeout=10)
        assert not rank0.is_running() or rank0.status() == psutil.STATUS_ZOMBIE
    finally:
        srv.close()


def test_tp2_server_killed_leaves_no_rank_and_no_port_behind(bundle_tp2, tmp_path):
    """SIGKILL of `qic serve` (the OOM killer) runs no handler: its ranks must die with it (PR_SET_PDEATHSIG)
    and free the port, or a restarted server finds it taken and the old ranks hold the memory."""
    srv = ServeProcess(bundle_tp2, tmp_path / "serve.log", "--tp", 2)
    try:
        tp_ranks(srv)   # both ranks up, rank 0 listening
        assert_die_with(srv.proc)
        with socket.socket() as s:   # what a restarted server does (qic.cli.serve._bind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", srv.port))
    finally:
        srv.close()


def test_server_imports_no_model_or_compiler_code():
    code = """
import sys
import qic.serve.app, qic.cli.serve, qic.serve.runner
print(sorted(m for m in sys.modules if m.startswith(("qic.models", "qic.builder", "qic.backends.inductor.build",
      "qic.backends.neuron.build", "torch._inductor", "torch._dynamo")) and m != "qic.backends.inductor.load"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_serve_refusals_are_one_line(bundle):
    proc = qic("serve", bundle, "--tp", "2", check=False)
    assert proc.returncode == 2 and "built for tp=1" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = qic("serve", bundle, "--port", taken.getsockname()[1], check=False)
    assert proc.returncode == 2 and "cannot listen on 127.0.0.1:" in proc.stderr, proc.stderr



def test_serve_runs_with_another_bundles_weights_as_qic_run_does(server, bundle, tmp_path):
    """--weights, --device and --verify-all load the bundle as `qic run` does: the server's PNG with a FAKE
    other bundle's weights (the session bundle's denoiser weights x 1.05, re-hashed) is `qic run --weights`'s,
    byte for byte, and its pixels differ from the plain server's (the comparison can tell the weights apart)."""
    import numpy as np
    other = rewritten_bundle(bundle, tmp_path / "other", "denoiser", lambda sd: {k: v * 1.05 for k, v in sd.items()})
    srv = ServeProcess(bundle, tmp_path / "serve.log", "--weights", other, "--device", "cpu", "--verify-all")
    try:
        status, _, body = gen(srv.port, seed=6)
    finally:
        srv.close()
    assert status == 200, body
    qic("run", bundle, "--weights", other, "--device", "cpu", "--verify-all", "--prompt", "a red bicycle",
        "--steps", STEPS, "--seed", 6, "--output", tmp_path / "run.png")
    assert png_of(body) == (tmp_path / "run.png").read_bytes()
    status, _, plain = gen(server.port, seed=6)
    texts = [Image.open(io.BytesIO(png_of(b))).text for b in (body, plain)]
    assert status == 200 and texts[0]["weights"] == json.loads((other / "manifest.json").read_text())["id"]
    assert "weights" not in texts[1]
    pixels = [np.asarray(Image.open(io.BytesIO(png_of(b))), dtype=np.int16) for b in (body, plain)]
    assert np.abs(pixels[0] - pixels[1]).max() > 8


def test_named_weight_sets_are_models_picked_per_request_and_mapped_within_the_budget(server, bundle, tmp_path):
    """--weights NAME=BUNDLE twice (two FAKE other bundles: the denoiser's weights x 1.05 and x 0.95), with a budget
    that maps one named set at a time: /v1/models lists the bundle's own and both; each request's `model` draws
    `qic run --weights`'s PNG for its set byte for byte (the bundle's own: the plain server's), after sets were
    unmapped and mapped again as the requests alternate, and mapping one again maps no more code; an unknown model
    is a 400 naming the served ones; a set whose tensors do not fit the graphs is one line at start."""
    from qic.serve.weight_sets import weight_bytes
    sets = {name: rewritten_bundle(bundle, tmp_path / name, "denoiser",
                                   lambda sd, f=f: {k: v * f for k, v in sd.items()})
            for name, f in (("x105", 1.05), ("x095", 0.95))}
    budget = 1.5 * weight_bytes(sets["x105"]) / 2**30   # GiB: one named set fits, two do not
    srv = ServeProcess(bundle, tmp_path / "serve.log", "--weights", f"x105={sets['x105']}",
                       "--weights", f"x095={sets['x095']}", "--weights-budget", repr(budget))
    try:
        status, _, listed = request(srv.port, "GET", "/v1/models")
        assert [m["id"] for m in listed["data"]] == [bundle.name, "x105", "x095"]
        served, maps = {}, []
        for model in ("x105", "x095", None, "x105"):
            status, _, body = gen(srv.port, seed=6, **({"model": model} if model else {}))
            assert status == 200, body
            served.setdefault(model, []).append(png_of(body))
            maps.append(len(Path(f"/proc/{srv.proc.pid}/maps").read_text().splitlines()))
        # a set mapped again runs the graphs' code already loaded (Graph.rebind), only its weight files are mapped:
        # loading the code again would map another copy of every graph's library each time (it is never unloaded)
        assert maps[3] == maps[1], maps
        status, _, body = gen(srv.port, model="nope")
        assert status == 400 and body["error"]["param"] == "model" and "'x105', 'x095'" in body["error"]["message"]
        metrics = scrape(srv.port)
        assert metrics[("qic_weight_set_maps_total", (("model", "x105"),))] == 3
        assert metrics[("qic_weight_set_maps_total", (("model", "x095"),))] == 2
        assert metrics[("qic_weight_sets_mapped", ())] == 1
    finally:
        srv.close()
    log = srv.log_path.read_text()
    # mapped at start (x105, then x095, which unmaps x105), then by the requests: x105, x095, and x105 again
    import re
    mapped = re.findall(r"^mapped weight set (\w+)", log, re.M)
    assert mapped == ["x105", "x095", "x105", "x095", "x105"], log
    assert "unmapped weight set x105" in log and "unmapped weight set x095" in log
    for name, path in sets.items():
        qic("run", bundle, "--weights", path, "--prompt", "a red bicycle", "--steps", STEPS, "--seed", 6,
            "--output", tmp_path / f"{name}.png")
        assert all(png == (tmp_path / f"{name}.png").read_bytes() for png in served[name]), name
    assert served["x105"][0] != served["x095"][0]
    assert served[None][0] == png_of(gen(server.port, seed=6)[2])
    bad = rewritten_bundle(bundle, tmp_path / "bad", "denoiser", lambda sd: {k: v[..., :1].contiguous() if v.ndim == 2
                                                                             else v for k, v in sd.items()})
    proc = qic("serve", bundle, "--port", "0", "--weights", f"bad={bad}", check=False)
    assert proc.returncode != 0 and "graph signatures differ" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr


def test_a_checkpoint_folder_is_cut_into_a_weight_set_and_served_as_a_model(bundle, tmp_path):
    """--weights NAME=DIR with a checkpoint folder (the bundle's architecture, other weights: the tiny preset at seed
    1): cut for the bundle's graphs under --cache-dir before the port opens (qic build --weights-for, in a process of
    its own), served as model NAME: its PNG is `qic run --weights SET`'s byte for byte and not the bundle's own; the
    next start finds the set in place; a folder that is neither a bundle nor a checkpoint is one line at start."""
    from qic.checkpoint.embedded import write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1)
    cache = tmp_path / "cache"
    pngs = []
    for start in range(2):
        srv = ServeProcess(bundle, tmp_path / f"serve{start}.log", "--weights", f"s1={ckpt}", "--cache-dir", cache)
        try:
            status, _, listed = request(srv.port, "GET", "/v1/models")
            assert [m["id"] for m in listed["data"]] == [bundle.name, "s1"]
            status, _, body = gen(srv.port, seed=6, model="s1")
            assert status == 200, body
            pngs.append(png_of(body))
        finally:
            srv.close()
    logs = [(tmp_path / f"serve{start}.log").read_text() for start in range(2)]
    assert f"weight set s1: checkpoint {ckpt} cut for" in logs[0] and "already cut" in logs[1], logs
    [made] = (cache / "weight-sets").iterdir()
    qic("run", bundle, "--weights", made, "--prompt", "a red bicycle", "--steps", STEPS, "--seed", 6,
        "--output", tmp_path / "s1.png")
    assert pngs[0] == pngs[1] == (tmp_path / "s1.png").read_bytes()
    qic("run", bundle, "--prompt", "a red bicycle", "--steps", STEPS, "--seed", 6, "--output", tmp_path / "own.png")
    assert pngs[0] != (tmp_path / "own.png").read_bytes()
    proc = qic("serve", bundle, "--port", "0", "--weights", f"nothing={tmp_path}", check=False)
    assert proc.returncode != 0 and "neither a qic bundle" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("flags, says", [(["--device", "neuron"], "runs on device cpu or cuda, not 'neuron'"),
                                         (["--weights", "{tmp}"], "not a qic bundle (no manifest.json)")],
                         ids=["device", "weights-not-a-bundle"])
def test_serve_refuses_load_flags_with_qic_runs_error(bundle, tmp_path, flags, says):
    """The same one-line error as `qic run` gives for the same flag (exit 2, no traceback)."""
    flags = [f.format(tmp=tmp_path) for f in flags]
    ran = qic("run", bundle, "--prompt", "x", *flags, check=False)
    served = qic("serve", bundle, "--port", 0, *flags, check=False, timeout=300)   # ignoring them, it would serve
    first = [next(line for line in p.stderr.splitlines() if line.startswith("error:")) for p in (ran, served)]
    assert ran.returncode == served.returncode == 2 and first[0] == first[1], (ran.stderr, served.stderr)
    assert says in first[1], first[1]
    assert "Traceback" not in served.stderr and "listening" not in served.stdout


def test_load_warm_up_and_every_batch_run_on_one_thread(bundle, monkeypatch):
    """Rank 0's torch work all runs on the runner's one thread (qic.serve.queue.compute_thread says why:
    a second OpenMP team made each image 3.7x slower with 2 threads on 2 cores). Before, the bundle was
    loaded and warmed on the main thread and the batches ran on the scheduler's own thread."""
    import asyncio

    from qic.runtime.generate import Request
    from qic.serve import runner as runner_mod
    from qic.serve.app import create_app
    from qic.serve.queue import compute_thread

    seen = {}
    real_bundle, real_warm = runner_mod.Bundle, runner_mod.warm

    def bundle_on(*a, **k):
        seen["load"] = threading.get_ident()
        return real_bundle(*a, **k)

    def warm_on(b):
        seen["warm"] = threading.get_ident()
        return real_warm(b)

    monkeypatch.setattr(runner_mod, "Bundle", bundle_on)
    monkeypatch.setattr(runner_mod, "warm", warm_on)
    compute = compute_thread()
    b, loaded = runner_mod.load(bundle, 0, 1, compute)   # as serve_rank loads; it warms through Scheduler.start
    assert loaded > 0
    runner = runner_mod.BundleRunner(b, None, executor=compute)
    real_run = runner.run

    def run_on(reqs):
        seen["run"] = threading.get_ident()
        return real_run(reqs)

    runner.run = run_on
    scheduler = create_app(runner).state.scheduler
    req = Request("a red bicycle", steps=STEPS)

    async def one_image():
        scheduler.start(lambda: runner_mod.warm(b))
        try:
            (job,) = scheduler.submit([(req, runner.plan(req))])
            return await job.future
        finally:
            await scheduler.stop()

    png = asyncio.run(one_image())
    assert png.startswith(b"\x89PNG")
    assert seen["load"] == seen["warm"] == seen["run"] != threading.get_ident(), seen
    assert scheduler.ready
