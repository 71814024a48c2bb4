"""Streamed partial images (qic.serve.stream) over a fake runner: the events' shape and order through the openai
client's streaming interface, which request of a batch gets which partial image, and the refusals. The real
bundle's stream (partial images against diffusers' own latents, the completed PNG against the unstreamed one) is in
tests/test_serve.py."""

from __future__ import annotations

import base64
import io
import threading

import pytest
from PIL import Image

from qic.serve.client import request
from qic.serve.stream import partial_steps
from tests.test_serve import SIZE, FakeRunner, ThreadServer, scrape

STEPS = 6


class PreviewingRunner(FakeRunner):
    """A FakeRunner whose runs hand out previews as a program's loop does: after each of STEPS steps, decode()
    gives one image per request, its pixel (request's index in the batch, step, 0) so a test can tell which
    request and step a partial image came from. `calls`: the steps whose images were decoded."""

    no_partials = None

    def __init__(self, batch_sizes=(1,)):
        super().__init__(batch_sizes)
        self.decoded: list[int] = []

    def run(self, reqs, previews=None):
        if previews is not None:
            for step in range(STEPS):
                def decode(wanted, step=step):
                    self.decoded.append((step, wanted))
                    return [Image.new("RGB", (4, 4), (j, step, 0)) if j in wanted else None
                            for j in range(len(reqs))]
                previews(step, STEPS, decode)
        return super().run(reqs)


def pixel(b64: str) -> tuple:
    return Image.open(io.BytesIO(base64.b64decode(b64))).getpixel((0, 0))


def client_of(port: int):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def test_partial_steps_are_spaced_evenly_and_never_the_last():
    assert partial_steps(3, 20) == {4: 0, 9: 1, 14: 2}
    assert partial_steps(2, 6) == {1: 0, 3: 1}
    assert partial_steps(1, 2) == {0: 0}
    assert partial_steps(3, 2) == {0: 0}      # a short run streams fewer, as the API allows
    assert partial_steps(3, 1) == {} and partial_steps(0, 20) == {}


def test_openai_client_streams_partial_images_then_the_completed_one():
    runner = PreviewingRunner()
    with ThreadServer(runner) as srv:
        events = list(client_of(srv.port).images.generate(prompt="a red bicycle", size=SIZE, stream=True,
                                                          partial_images=2, extra_body={"seed": 5}))
        metrics = scrape(srv.port)
    assert metrics[("qic_partial_images_total", ())] == 2 and metrics[("qic_images_total", (("outcome", "ok"),))] == 1
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert [pixel(e.b64_json)[:2] for e in events[:2]] == [(0, 1), (0, 3)]   # steps 1 and 3 of 6
    assert runner.decoded == [(1, [0]), (3, [0])]                           # no other step was decoded
    assert base64.b64decode(events[2].b64_json) == b"seed 5"                # the runner's own output, untouched
    assert events[2].size == SIZE and events[2].output_format == "png"


def test_without_partial_images_a_stream_is_the_completed_event_and_nothing_is_decoded():
    runner = PreviewingRunner()
    with ThreadServer(runner) as srv:
        events = list(client_of(srv.port).images.generate(prompt="a red bicycle", size=SIZE, stream=True))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert runner.decoded == []


def test_a_batch_streams_each_request_its_own_images():
    """Two requests in one batch, the second streaming: its partial images are the batch's second image."""
    runner = PreviewingRunner(batch_sizes=(1, 2))
    runner.gate.clear()
    with ThreadServer(runner, max_batch=2) as srv:
        blocker = threading.Thread(target=request, args=(srv.port, "POST", "/v1/images/generations",
                                                         {"prompt": "first", "seed": 1}))
        blocker.start()
        assert runner.started.wait(10)          # the first runs alone, held at the gate; the next two queue
        plain = threading.Thread(target=request, args=(srv.port, "POST", "/v1/images/generations",
                                                       {"prompt": "a", "seed": 2}))
        plain.start()
        streamed: list = []
        streaming = threading.Thread(target=lambda: streamed.extend(client_of(srv.port).images.generate(
            prompt="b", size=SIZE, stream=True, partial_images=1, extra_body={"seed": 3})))
        streaming.start()
        until_queued(srv, 2)
        runner.gate.set()
        for t in (blocker, plain, streaming):
            t.join(30)
    assert runner.batches == [[1], [2, 3]]
    assert [e.type for e in streamed] == ["image_generation.partial_image", "image_generation.completed"]
    assert pixel(streamed[0].b64_json)[:2] == (1, 2)   # request 1 of the batch, step 2 of 6
    assert runner.decoded == [(2, [1])]                # only the streaming request's picture was decoded
    assert base64.b64decode(streamed[1].b64_json) == b"seed 3"


def until_queued(srv, n: int) -> None:
    import time
    deadline = time.monotonic() + 10
    while len(srv.app.state.scheduler.pending) != n:
        assert time.monotonic() < deadline, "requests did not queue"
        time.sleep(0.02)


def test_edits_stream_image_edit_events():
    runner = PreviewingRunner()
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    with ThreadServer(runner) as srv:
        events = list(client_of(srv.port).images.edit(image=("in.png", png.getvalue(), "image/png"),
                                                      prompt="make it red", stream=True, partial_images=1,
                                                      extra_body={"seed": 7}))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]


def test_a_failed_run_after_the_stream_began_is_an_error_event_the_client_raises():
    from openai import APIError

    class Failing(PreviewingRunner):
        def run(self, reqs, previews=None):
            previews(1, STEPS, lambda wanted: [Image.new("RGB", (4, 4))])
            raise RuntimeError("the decoder broke")

    with ThreadServer(Failing()) as srv:
        got = []
        with pytest.raises(APIError, match="generation failed: RuntimeError: the decoder broke"):
            for e in client_of(srv.port).images.generate(prompt="x", size=SIZE, stream=True, partial_images=2):
                got.append(e.type)
    assert got == ["image_generation.partial_image"]   # what came before the failure still came


@pytest.mark.parametrize("body, param, says", [
    ({"partial_images": 2}, "partial_images", "give stream true"),
    ({"stream": True, "n": 2}, "n", "a stream carries one image"),
    ({"stream": True, "partial_images": 4}, "partial_images", "less than or equal to 3"),
    ({"stream": True, "partial_images": 1, "_no_partials": "its ranks run in lockstep"}, "partial_images",
     "this server makes none: its ranks run in lockstep"),
])
def test_stream_refusals_are_one_400_naming_the_field(body, param, says):
    runner = PreviewingRunner()
    runner.no_partials = body.pop("_no_partials", None)
    with ThreadServer(runner, max_n=4) as srv:
        status, _, answer = request(srv.port, "POST", "/v1/images/generations", {"prompt": "x", **body})
    assert status == 400 and answer["error"]["param"] == param and says in answer["error"]["message"], answer
    assert runner.batches == []


def test_a_client_that_leaves_a_stream_cancels_its_queued_request():
    import http.client
    import json
    import socket
    runner = PreviewingRunner()
    runner.gate.clear()
    with ThreadServer(runner) as srv:
        first = threading.Thread(target=request, args=(srv.port, "POST", "/v1/images/generations",
                                                       {"prompt": "x", "seed": 1}))
        first.start()
        assert runner.started.wait(10)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("POST", "/v1/images/generations", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": "x", "seed": 2, "stream": True, "partial_images": 1}))
        assert conn.getresponse().status == 200    # the stream has begun: its status line is sent
        until_queued(srv, 1)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        until_queued(srv, 0)
        runner.gate.set()
        first.join(30)
    assert runner.batches == [[1]]   # seed 2 never ran


def test_a_failed_preview_ends_the_partial_images_not_the_batch():
    """A preview that raises (a decode failing) is logged and stops that batch's partial images; the images
    themselves are still made and the stream ends with the completed one."""
    class BrokenDecoder(PreviewingRunner):
        def run(self, reqs, previews=None):
            def decode(wanted):
                raise RuntimeError("decoder out of memory")
            for step in range(STEPS):
                previews(step, STEPS, decode)
            return FakeRunner.run(self, reqs)

    with ThreadServer(BrokenDecoder()) as srv:
        events = list(client_of(srv.port).images.generate(prompt="x", size=SIZE, stream=True, partial_images=3,
                                                          extra_body={"seed": 4}))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert base64.b64decode(events[0].b64_json) == b"seed 4"
