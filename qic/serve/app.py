"""HTTP routes in the OpenAI images API's shape, its error bodies, and a structured access log."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from collections.abc import Hashable
from contextlib import asynccontextmanager
from typing import Literal, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.exceptions import HTTPException

from qic.errors import QicError
from qic.host.options import HTTP, given_at, untaken
from qic.runtime.png import step_cache_of
from qic.serve.metrics import Metrics
from qic.serve.queue import QueueFull, Scheduler, Unavailable
from qic.serve.settings import Settings
from qic.serve.stream import MAX_PARTIALS, PartialImages, batch_previews, error_event, image_event

access_log = logging.getLogger("qic.serve.access")


class _OpenAIFields(BaseModel):
    """POST /v1/images/generations: the OpenAI images API's fields. Strict types: "2" is not a number. Unknown
    keys are refused."""
    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = Field(1, ge=1)
    size: str = "auto"
    response_format: Literal["b64_json"] = "b64_json"
    model: str | None = None
    user: str | None = None
    stream: bool = False                                    # server-sent events (qic.serve.stream)
    partial_images: int = Field(0, ge=0, le=MAX_PARTIALS)   # with stream: partial images before the completed one


def _field(option):
    """A request field from a run option's row (qic.host.options): its type, range and default are `qic run`'s,
    so the same settings give the same image. Steps and guidance left out stay None: the runtime's `validate`
    fills in the bundle's run defaults (else 20 / 4), as it does for `qic run` without flags."""
    optional = option.nullable or (option.default is None and not option.required)
    kind = option.kind | None if optional else option.kind
    bounds = {"ge": option.minimum, "lt": option.below}
    if option.kind is str:
        bounds = {"min_length": int(option.minimum or 0)}
    elif option.kind is float:
        bounds["allow_inf_nan"] = False
    default = ... if option.required else option.default
    return kind, Field(default, **{k: v for k, v in bounds.items() if v is not None})


# qic's extensions: every run option a request may carry (where HTTP is listed in its row), with its row's checks.
ImageRequest = create_model("ImageRequest", __base__=_OpenAIFields,
                            **{o.name: _field(o) for o in given_at(HTTP)})
_REQUEST_FIELDS = tuple(o.name for o in given_at(HTTP) if o.request)


class EditRequest(ImageRequest):
    """POST /v1/images/edits' fields other than its files: a multipart form's values are strings, so they convert
    as their types say ("3" is a number here), with the same ranges. nearest_condition_size: a condition image
    whose size the bundle was not built for is resized to the nearest built size instead of refused (edit
    bundles); strength: img2img's (a text-to-image bundle built with the VAE encoder)."""
    model_config = ConfigDict(extra="forbid", strict=False)
    nearest_condition_size: bool | None = None
    strength: float | None = Field(None, gt=0, le=1)


EDIT_FILES = ("image", "image[]", "mask")   # the OpenAI client sends one image as image, several as image[]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers


def error_response(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def create_app(runner, settings: Settings = Settings(), on_fail=None, warm_up=None) -> FastAPI:
    """runner: .program (the bundle's host program: its Request), .plan(request) -> batch key (raises QicError),
    .run(list) -> list of PNG bytes, .model_id, .created, .sizes ({"WxH": (h, w)}), .batch_sizes; optionally
    .executor, the thread to run on, and .stage_clock (qic.serve.metrics.StageClock: /metrics' seconds by stage).
    warm_up: called on the runner's thread before any batch, once the server has started (qic serve's: every graph
    once, and at tp > 1 the control group); until it returns /health and /health/ready answer 503 "warming" and
    image requests wait in the queue; if it raises, the runner is gone for good (below). /health/live answers 200
    unless the runner is gone.

    The runner is gone for good when its run raises queue.Unavailable or app.state.fail(reason) is called
    (from any thread or a signal handler): /health answers 503 and every queued, running and later image
    request 503 with the reason; then on_fail(error) is called on the event loop (the server stops)."""
    clock = getattr(runner, "stage_clock", None)
    # A streamed request's partial images by id() of its Request (the scheduler's item): added on the event loop
    # before the request queues, read on the runner's thread while its batch runs.
    partials: dict[int, PartialImages] = {}

    def run_batch(items: list, key: tuple) -> list:   # on the runner's thread: one batch, and what it cost
        if clock is not None:
            clock.take()   # drop what ran outside a batch (the warm-up)
        t = time.perf_counter()
        model = getattr(key, "model", None)   # _plan's BatchKey
        model = None if model == runner.model_id else model
        hooks = {"previews": batch_previews([partials.get(id(item)) for item in items]), "model": model}
        out = runner.run(items, **{k: v for k, v in hooks.items() if v is not None})
        metrics.batch(len(items), time.perf_counter() - t, clock.take() if clock is not None else {})
        return out

    scheduler = Scheduler(run_batch, settings.queue, [s for s in runner.batch_sizes if s <= settings.max_batch],
                          getattr(runner, "executor", None), on_fail)
    metrics = Metrics(scheduler, scheduler.batch_sizes, getattr(runner, "sets", None),
                      getattr(getattr(runner, "bundle", None), "adapters", None))
    loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def lifespan(app):
        nonlocal loop
        loop = asyncio.get_running_loop()
        scheduler.start(warm_up)
        yield
        await scheduler.stop()

    def fail(reason: str) -> None:
        # The scheduler and the request futures belong to the event loop: hand the failure to it.
        if loop is None:
            scheduler.fail(Unavailable(reason))   # not serving yet: no loop, nothing to race with
        elif not loop.is_closed():
            loop.call_soon_threadsafe(scheduler.fail, Unavailable(reason))

    app = FastAPI(title="qic serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.fail = fail
    app.add_middleware(AccessLog, metrics=metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(ApiError(400, "the request body is not valid JSON"))
        param = ".".join(loc) or None
        return error_response(ApiError(400, f"{param or 'body'}: {err.get('msg')}", param))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return error_response(ApiError(e.status_code, str(e.detail), type_="invalid_request_error"))

    def health_body() -> tuple[int, dict]:
        body = {"status": "ok", "live": True, "ready": True, "model": runner.model_id,
                "queued": len(scheduler.pending), "running": scheduler.running}
        if scheduler.failed is not None:   # a supervisor's probe: take this instance out and restart it
            return 503, {**body, "status": "unavailable", "live": False, "ready": False,
                         "reason": str(scheduler.failed)}
        if not scheduler.ready:   # up, but not every graph has run yet
            return 503, {**body, "status": "warming", "ready": False}
        return 200, body

    @app.get("/health")
    @app.get("/health/ready")
    async def health():
        """Ready: every graph has run once and the runner can make images (a load balancer's check)."""
        status, body = health_body()
        return JSONResponse(body, status_code=status)

    @app.get("/health/live")
    async def live():
        """Live: the server answers and its runner has not failed for good (a failed one only stops)."""
        _, body = health_body()
        return JSONResponse(body, status_code=200 if body["live"] else 503)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": runner.created,
                                             "owned_by": "qic"} for name in served_models(runner)]}

    @app.post("/v1/images/generations")
    async def generations(body: ImageRequest, request: Request):
        _check_stream(runner, body)
        items = _plan(runner, settings, body)
        if body.stream:
            return _stream(body, items, request, "image_generation")
        return await _serve(body, items, request)

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        """The OpenAI images API's edits: a multipart form with the image(s) (`image`, or `image[]` for several, in
        prompt order), the prompt and the generation fields; an edit bundle's program reads the images as
        conditions, a text-to-image bundle built with the VAE encoder starts from the one image (img2img; with a
        `mask`, inpaint)."""
        body, images, mask = await _edit_form(await request.form())
        if "image" not in runner.program.Request.__dataclass_fields__:
            raise ApiError(400, f"this model edits no images (its host program is {runner.program.__name__}); "
                                "POST /v1/images/generations", "image")
        request.state.log["images"] = len(images)
        _check_stream(runner, body)
        extra = {"image": images, "mask": mask, "nearest_condition_size": body.nearest_condition_size,
                 "strength": body.strength}
        items = _plan(runner, settings, body, extra)
        if body.stream:
            return _stream(body, items, request, "image_edit")
        return await _serve(body, items, request)

    def _submit(body, items, log: dict) -> list:
        log.update(n=body.n, size=body.size, steps=items[0][0].steps, seed=body.seed)   # steps: as resolved
        try:
            return scheduler.submit(items)
        except Unavailable as e:
            raise _unavailable(e) from None
        except QueueFull as e:
            log["rejected"] = "queue full"
            raise ApiError(429, f"the queue is full ({settings.queue} images waiting); retry after {e.retry_after} s",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None

    def _log_start(jobs, log: dict) -> list:
        started = [j.started for j in jobs if j.started is not None]
        if started:
            log["queue_s"] = round(min(started) - jobs[0].enqueued, 4)
            log["batch"] = max(j.batch for j in jobs)
        return started

    async def _serve(body, items, request: Request):
        log = request.state.log
        jobs = _submit(body, items, log)
        outcome = await _wait(request, [j.future for j in jobs], settings.timeout)
        started = _log_start(jobs, log)
        if outcome != "done":
            cancelled = sum(scheduler.cancel(j) for j in jobs)
            log["cancelled_queued"] = cancelled
            if outcome == "disconnected":
                log["rejected"] = "client disconnected"
                return JSONResponse({}, status_code=499)  # nginx's code; nobody is there to read it
            raise ApiError(504, f"no image within the server's {settings.timeout:g} s timeout",
                           type_="timeout_error", code="timeout")
        try:
            pngs = [f.result() for f in (j.future for j in jobs)]
        except Exception as e:
            raise _failed(e, len(jobs), log) from None
        metrics.images.labels("ok").inc(len(pngs))
        log["run_s"] = round(time.perf_counter() - min(started), 4)
        cached = [step_cache_of(p) for p in pngs]
        if any(cached):
            log["step_cache"] = cached   # per image: its settings and the steps each CFG branch computed
        return {"created": int(time.time()), "output_format": "png", "size": body.size,
                "data": [{"b64_json": base64.b64encode(p).decode("ascii")} for p in pngs]}

    def _failed(e: Exception, images: int, log: dict) -> ApiError:
        """A run that failed (Unavailable: the runner is gone), logged and counted: the error to answer with."""
        log["error"] = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {e}"
        metrics.images.labels("error").inc(images)
        if isinstance(e, Unavailable):
            return _unavailable(e)
        return ApiError(500, f"generation failed: {type(e).__name__}: {e}", type_="server_error")

    def _stream(body, items, request: Request, kind: str) -> StreamingResponse:
        """stream: true (one image, _check_stream): admitted as any request (429 and 503 before the stream
        begins), then its partial images and the completed one as server-sent events (qic.serve.stream); a
        failure after that is an error event. A client that goes away cancels the request if it is still queued."""
        log = request.state.log
        log["stream"] = True
        req = items[0][0]
        sink = PartialImages(body.partial_images, asyncio.get_running_loop())
        partials[id(req)] = sink
        try:
            (job,) = _submit(body, items, log)
        except BaseException:
            partials.pop(id(req), None)
            raise
        size = body.size if body.size != "auto" else f"{req.width}x{req.height}"
        # If the generator below never starts (the response is dropped before it is sent), its finally cannot
        # clean up: the job's end does (its batch has run by then, and reads them no more).
        job.future.add_done_callback(lambda _: partials.pop(id(req), None))

        def partial(index_png) -> bytes:
            nonlocal sent
            sent += 1
            metrics.partials.inc()
            return image_event(kind, index_png[1], size, index_png[0])

        sent = 0

        async def events():
            waiting = None
            deadline = time.monotonic() + settings.timeout
            try:
                while True:
                    waiting = asyncio.ensure_future(sink.queue.get())
                    done, _ = await asyncio.wait({waiting, job.future}, timeout=max(0.0, deadline - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if waiting in done:
                        yield partial(waiting.result())
                        continue
                    waiting.cancel()
                    if not done:
                        log["error"] = "timeout"
                        _log_start([job], log)
                        yield error_event(f"no image within the server's {settings.timeout:g} s timeout",
                                          "timeout_error", "timeout")
                        return
                    # The partial images were queued before the run returned (the future is set after it), so
                    # none comes later: what is queued now is all of them.
                    while not sink.queue.empty():
                        yield partial(sink.queue.get_nowait())
                    try:
                        png = job.future.result()
                    except asyncio.CancelledError:   # the server stopped before it ran
                        log["error"] = "cancelled: the server is stopping"
                        yield error_event("the server stopped before the image was made", "server_error",
                                          "unavailable")
                        return
                    except Exception as e:
                        _log_start([job], log)
                        failed = _failed(e, 1, log)
                        yield error_event(failed.message, failed.type, failed.code)
                        return
                    metrics.images.labels("ok").inc()
                    started = _log_start([job], log)
                    log["run_s"] = round(time.perf_counter() - min(started), 4)
                    yield image_event(kind, png, size)
                    return
            finally:
                if waiting is not None:
                    waiting.cancel()
                sink.closed = True   # a batch still running makes no more for it
                partials.pop(id(req), None)
                log["partial_images"] = sent
                if not job.future.done():   # the client went away (or the stream timed out)
                    log["cancelled_queued"] = int(scheduler.cancel(job))
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _check_stream(runner, body) -> None:
    """stream and partial_images: one image a stream (its events name no image), partial images only in a stream
    and only from a bundle that makes them; each refusal one 400 naming the field."""
    if body.stream and body.n != 1:
        raise ApiError(400, f"n is {body.n}; a stream carries one image (its events name no image): give n 1", "n")
    if body.partial_images and not body.stream:
        raise ApiError(400, "partial_images come as server-sent events: give stream true, or partial_images 0",
                       "partial_images")
    refused = getattr(runner, "no_partials", None)
    if body.partial_images and refused:
        raise ApiError(400, f"partial_images: this server makes none: {refused}", "partial_images")


def _unavailable(e: Unavailable) -> ApiError:
    return ApiError(503, f"the server can make no more images: {e}", type_="server_error", code="unavailable")


class AccessLog:
    """One JSON line per request: method, path, status, timings, and what the route added to
    request.state.log (images, queue and run seconds, batch size, why it was refused); and the request counted in
    /metrics."""

    def __init__(self, app, metrics: Metrics | None = None):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t = time.perf_counter()
        status = 500   # what the server's error handler sends if the app raises
        extra: dict = {}
        scope.setdefault("state", {})["log"] = extra

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client")
            record = {"method": scope["method"], "path": scope["path"], "status": status,
                      "client": client[0] if client else None, "total_s": round(time.perf_counter() - t, 4),
                      **extra}
            access_log.info(json.dumps(record))
            if self.metrics is not None:
                self.metrics.request(scope["path"], status)


async def _edit_form(form) -> tuple[EditRequest, list, object]:
    """An edits form's fields as EditRequest (400 naming a bad one), its images and its mask (None without one),
    decoded now (400 naming a file that is no readable image)."""
    fields = {k: v for k, v in form.multi_items() if k not in EDIT_FILES}
    try:
        body = EditRequest.model_validate(fields)
    except ValidationError as e:   # the first error, as the JSON routes answer
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise ApiError(400, f"{param or 'form'}: {err.get('msg')}", param) from None
    files = form.getlist("image") + form.getlist("image[]")
    if not files:
        raise ApiError(400, "image: an edit needs at least one image file", "image")
    images = [await _decoded(f, "image") for f in files]
    masks = form.getlist("mask")
    if len(masks) > 1:
        raise ApiError(400, "mask: one mask file", "mask")
    return body, images, (await _decoded(masks[0], "mask") if masks else None)


async def _decoded(upload, param: str):
    """An uploaded file as a decoded PIL image (a truncated one fails here), or a 400 naming it."""
    from PIL import Image
    if isinstance(upload, str):
        raise ApiError(400, f"{param}: expected a file upload, got a text field", param)
    try:
        with Image.open(io.BytesIO(await upload.read())) as im:
            im.load()
            return im.copy()
    except Exception as e:   # PIL's many decode errors: one line naming the upload
        raise ApiError(400, f"{param}: {upload.filename or 'an upload'} is not a readable image ({type(e).__name__})",
                       param) from None


def _plan(runner, settings: Settings, body: ImageRequest, extra: dict | None = None) -> list[tuple]:
    """One generation request per image (seeds seed, seed+1, ...), each checked against the bundle. `extra`: the
    edits' fields (the images, nearest_condition_size), which the program's Request takes as it is."""
    if body.n > settings.max_n:
        raise ApiError(400, f"n is {body.n}; this server makes at most {settings.max_n} images a request", "n")
    # A request's images are admitted together, so more than the whole queue would get 429 forever.
    if body.n > settings.queue:
        raise ApiError(400, f"n is {body.n}, but this server's queue holds at most {settings.queue} images "
                            f"(--queue {settings.queue}); ask for fewer or start it with a larger --queue", "n")
    served = served_models(runner)
    if body.model is not None and body.model not in served:
        raise ApiError(400, f"model {body.model!r} is not served here; it serves {', '.join(map(repr, served))}",
                       "model")
    if body.size == "auto":
        height = width = None
    elif body.size in runner.sizes:
        height, width = runner.sizes[body.size]
    else:
        raise ApiError(400, f"size {body.size!r} is not in this bundle; it has: {', '.join(runner.sizes)} "
                            "(WIDTHxHEIGHT) or auto", "size")
    # Fields the bundle's host program takes; one it does not take, given, is refused by name (never dropped).
    request = runner.program.Request
    given = {k: getattr(body, k) for k in _REQUEST_FIELDS if getattr(body, k) is not None}
    refused = untaken(request, given)
    if refused:
        raise ApiError(400, f"{refused[0]}: this model's runs take no such option (its host program is "
                            f"{runner.program.__name__})", refused[0])
    fields = {k: getattr(body, k) for k in _REQUEST_FIELDS if k in request.__dataclass_fields__}
    given_extra = {k: v for k, v in (extra or {}).items() if v is not None}
    for k in given_extra:
        if k not in request.__dataclass_fields__:
            raise ApiError(400, f"{k}: this model's runs take no such option (its host program is "
                                f"{runner.program.__name__})", k)
    fields |= given_extra
    items = []
    for i in range(body.n):
        req = request(**fields | dict(seed=body.seed + i, height=height, width=width))
        try:
            key = runner.plan(req)
        except QicError as e:
            raise ApiError(400, e.message, "prompt" if "prompt" in e.message else None) from None
        items.append((req, BatchKey(body.model or runner.model_id, key)))
    return items


class BatchKey(NamedTuple):
    """A request's batch key: requests share a batch only with requests of the same model (weight set: one set's
    weights run a batch) and the same program key (its graphs and scalars: the host program's `plan`)."""
    model: str
    program: Hashable


def served_models(runner) -> list[str]:
    """The model names a runner serves: the bundle's own first, then its named weight sets."""
    return list(getattr(runner, "models", None) or [runner.model_id])


async def _wait(request: Request, futures: list[asyncio.Future], timeout: float) -> str:
    """'done', 'disconnected' or 'timeout', whichever comes first."""
    results = asyncio.gather(*futures, return_exceptions=True)
    # Cancelled below (a hang-up, a timeout), the gather ends in CancelledError that nothing awaits: retrieved here,
    # or asyncio logs "exception was never retrieved" with a traceback for every hung-up request.
    results.add_done_callback(lambda f: f.cancelled() or f.exception())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if results in done:
        return "done"
    results.cancel()
    return "disconnected" if gone in done else "timeout"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
