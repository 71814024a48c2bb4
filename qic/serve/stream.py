"""Streamed partial images, as the OpenAI images API streams them: with `stream: true` a generation (or an edit)
answers server-sent events, `partial_images` (0-3) `<kind>.partial_image` events and then one `<kind>.completed`
event (kind `image_generation` or `image_edit`), each a JSON object whose `b64_json` holds a PNG.

A partial image is the clean picture a denoise step predicts (qic.runtime.loop: read from the step's Euler update),
decoded by the bundle's decoder graph at steps spaced evenly through the run; the completed image is the PNG the
same request gets unstreamed. A run with fewer steps than that streams fewer partial images, as the API allows
("the final image may be sent before the full number of partial images are generated").
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

MAX_PARTIALS = 3   # the API's range: 0-3
log = logging.getLogger("qic.serve")


def partial_steps(count: int, steps: int) -> dict[int, int]:
    """loop step -> partial image index: `count` steps spaced evenly through a run of `steps` (after the
    (k+1)/(count+1)-th part of it), leaving out the last step, whose picture is the completed image."""
    picked = sorted({(k + 1) * steps // (count + 1) - 1 for k in range(count)} & set(range(steps - 1)))
    return {step: k for k, step in enumerate(picked)}


class PartialImages:
    """One streamed request's partial images: made on the runner's thread, queued on the event loop's."""

    def __init__(self, count: int, loop: asyncio.AbstractEventLoop):
        self.count = count
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False   # its stream has ended (client gone, timed out): make no more

    def index(self, step: int, steps: int) -> int | None:
        return None if self.closed else partial_steps(self.count, steps).get(step)

    def send(self, index: int, image) -> None:
        buf = io.BytesIO()
        image.save(buf, format="PNG", compress_level=1)   # on the compute thread: the fastest of zlib's levels
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, buf.getvalue()))
        except RuntimeError:   # the loop has closed (the server is gone): nobody reads it
            self.closed = True


def batch_previews(sinks: list[PartialImages | None]):
    """qic.runtime.loop's previews for a batch whose requests stream into `sinks` (None: that request does not), or
    None when none does. A step decodes the batch's predicted images only when some request wants that step's."""
    if not any(s is not None and s.count for s in sinks):
        return None

    def previews(step: int, steps: int, decode) -> None:
        wanted = [(j, s.index(step, steps)) for j, s in enumerate(sinks) if s is not None]
        wanted = [(j, k) for j, k in wanted if k is not None]
        if not wanted:
            return
        try:
            images = decode([j for j, _ in wanted])
            for j, k in wanted:
                if images[j] is not None:   # None: another rank's image (CFG-parallel's halves): it streams fewer
                    sinks[j].send(k, images[j])
        except Exception:   # a preview is not worth the batch: its images, and at tp > 1 the server, go on
            log.exception(f"partial images after step {step} failed; the batch's streams get no more")
            for j, _ in wanted:
                sinks[j].closed = True
    return previews


def event(data: dict) -> bytes:
    """One server-sent event: its type as the event name, the object as its data."""
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def image_event(kind: str, png: bytes, size: str, partial_index: int | None = None) -> bytes:
    """A partial image (partial_index given) or the completed one, in the API's event shape."""
    import base64
    data = {"type": f"{kind}.partial_image" if partial_index is not None else f"{kind}.completed",
            "b64_json": base64.b64encode(png).decode("ascii"), "created_at": int(time.time()), "size": size,
            "quality": "auto", "background": "auto", "output_format": "png"}
    if partial_index is not None:
        data["partial_image_index"] = partial_index
    return event(data)


def error_event(message: str, type_: str, code: str | None = None) -> bytes:
    """An error after the stream has begun (its status line already sent): the API's error object as an event's
    data, which the openai client raises as APIError."""
    return event({"type": "error", "error": {"message": message, "type": type_, "param": None, "code": code}})
