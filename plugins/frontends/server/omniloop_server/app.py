"""The HTTP API (Starlette), served by uvicorn.

=====================================  ===========================================================
``POST /v1/videos``                    submit a video job (JSON or OpenAI's multipart form) →
                                       OpenAI's ``Video`` object ``{id, object, status, progress, ...}``
``GET /v1/videos``                     list jobs (``after``, ``limit``, ``order``; cursor pagination)
``GET /v1/videos/{id}``                a job's status and progress (``openai-poll-after-ms`` header)
``GET /v1/videos/{id}/content``        the mp4 (``?variant=thumbnail|spritesheet``: png); 404
                                       unknown, 409 until the job completed (or: it was cancelled)
``GET /v1/videos/{id}/events``         server-sent events: ``status``, ``progress``..., ``done``
``POST /v1/videos/{id}/cancel``        cancel a queued/running job, keep its record
``WS /v1/videos/stream``               WebSocket: frames of each chunk as it is decoded (causal
                                       Wan), progress, continue a session; see :mod:`.ws`
``DELETE /v1/videos/{id}``             delete a job (cancelling it first if it still runs)
``POST /v1/images/generations``        OpenAI-like; waits, returns ``data: [{b64_json}]`` (png)
``POST /v1/images/edits``              i2i (multipart as the SDK sends it, or JSON); see :mod:`.images`
``POST /v1/audio/speech``              t2a (OpenAI's audio.speech shape): the audio file's bytes;
``POST /v1/audio/generations``         audio jobs (poll, ``/content``); see :mod:`.audio`
``POST /v1/chat/completions``          text (``reason``) deployments; SSE chunks with ``stream``;
``POST /v1/completions``               see :mod:`.chat`
``GET /v1/models[/{id}]``              the served model
``GET /health``                        liveness + queue state (503 when the engine died or drains)
``GET /metrics``                       Prometheus text
=====================================  ===========================================================

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a body
that cannot be read (not JSON, not UTF-8, malformed multipart, empty), 415 for a Content-Type the
endpoint does not take, 413 for a body over :data:`MAX_BODY_BYTES`, 422 for a readable body with
an invalid field (``param`` the dotted body field path; ``detail`` repeats it FastAPI-style),
404, 409, 429 (queue full), 503 (shutting down). Echoed client values are truncated. An exception
nobody expected is answered with a 500 in the same shape (counted in ``/metrics``), and the
keep-alive connection stays usable.

Shutdown (:meth:`ServerState.drain`): stop admitting (new jobs get 503), let in-flight jobs finish
for ``shutdown_timeout`` seconds, cancel what still runs, and append every job's final state to
``<output folder>/jobs.jsonl``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from omniloop.errors import RequestError
from omniloop.request import TaskType
from omniloop_scheduler import AdmissionRefused, AsyncEngine, EngineClosed, QueueFull

from .admin import admin_routes
from .audio import audio_routes
from .bodies import (
    MAX_IMAGE_BYTES,
    BodyTooLarge,
    MappedBody,
    body_fingerprint,
    check_tree,
    form_to_body,
    map_image_body,
    map_video_body,
    parse_json,
    show,
)
from .body_schema import InvalidBody
from .chat import text_routes
from .extensions import mount
from .images import base_url, image_edit_routes, images_response
from .jobs import Job, JobStore
from .jsonbody import JsonProcesses, StringCaps
from .metrics import render_metrics
from .openapi import docs_page, openapi_document
from .options import (
    CostBudget,
    NoRoom,
    ServerOptions,
    admission_check,
    check_image_use,
    check_images,
    check_texts,
    cost_check,
    kv_room_check,
    parse_server_options,
)
from .ws import video_stream_routes

log = logging.getLogger("omniloop.server")

#: the default of ``server.max_body_bytes`` (:mod:`.options`: every limit one client meets)
MAX_BODY_BYTES = 32 * 1024 * 1024
#: uploaded files in one multipart body (images.edit: image[] + mask)
MAX_FORM_FILES = 12
SSE_KEEPALIVE_S = 15.0
#: Idempotency-Keys of POST /v1/videos remembered (oldest forgotten first)
MAX_IDEMPOTENCY_KEYS = 10_000
#: the longest error message / param sent back (client values inside are truncated already)
MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 1000, 200
#: after the grace period: how long the cancel may take to land (it waits for the step in flight),
#: then how long the last mp4 writes may take; a job still unfinished then is recorded cancelled
STOP_GRACE_S, WRITE_GRACE_S = 10.0, 10.0
VARIANTS = {"video": "video/mp4", "thumbnail": "image/png", "spritesheet": "image/png"}


def _clean(text: str, limit: int) -> str:
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error(
    status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error in OpenAI's shape (422s also carry a FastAPI-style ``detail``)."""
    message = _clean(str(message), MAX_MESSAGE_CHARS)
    param = _clean(str(param), MAX_PARAM_CHARS) if param is not None else None
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code or type_}}
    if status == 422:
        loc = ["body"] if param in (None, "", "body") else ["body", *param.split(".")]
        body["detail"] = [{"loc": loc, "msg": message, "type": "value_error"}]
    return JSONResponse(body, status_code=status, headers=headers)


def refuse_in_process(deploy: Any) -> None:
    """What ``omniloop serve`` cannot drive in its process (a composed or a parallel deploy), refused
    with one message — :func:`omniloop.deploy.check_in_process`, shared with the Dynamo worker."""
    from omniloop.deploy import DeployConfig, check_in_process

    if isinstance(deploy, DeployConfig):
        check_in_process(deploy, "omniloop serve")


class ServerState:
    def __init__(self, engine: AsyncEngine, output_dir: Path, max_finished_jobs: int, shutdown_timeout: float,
                 poll_after_ms: int, options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.runtime = engine.runtime
        self.options = options or ServerOptions()
        #: request preparation (parsing, mapping, tokenising, image decoding, resolve) runs here,
        #: never on the event loop: one heavy body cannot stall /health or anyone else's stream
        self.prepare_pool = concurrent.futures.ThreadPoolExecutor(self.options.prepare_threads,
                                                                  thread_name_prefix="omniloop-prepare")
        #: the cost of admitted, unfinished requests (server.max_inflight_cost; None: no budget)
        self.cost_budget = (CostBudget(self.options.max_inflight_cost, self.options.retry_after_s)
                            if self.options.max_inflight_cost is not None else None)
        #: large JSON bodies are parsed in helper processes (json.loads holds the GIL: .jsonbody)
        self.json_processes = JsonProcesses(self.options.prepare_threads)
        self.max_image_pixels = self.options.image_pixels(getattr(engine.runtime.deploy, "limits", None))
        self.jobs = JobStore(output_dir, max_finished_jobs)
        self.jobs.restore()  # a restart on the same folder lists the earlier jobs again (jobs.py)
        self.public_url: str | None = None
        #: POST /v1/videos Idempotency-Key -> job id (None while the first request is accepted)
        self.idempotent: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self.started_at = time.time()
        self.http_errors: dict[int, int] = {}
        #: bodies refused by their schema (omniloop_server.body_schema) before reaching the engine
        self.invalid_bodies = 0
        self.unhandled_errors = 0
        self.shutdown_timeout = shutdown_timeout
        self.poll_after_ms = poll_after_ms
        self.draining = False
        #: in-flight engine requests that are not video jobs (chat, completions, images): the drain
        #: gives them the same grace period, then cancels them
        self.requests: dict[str, Any] = {}
        self._drain_task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        rt = self.runtime
        self.model_id = rt.deploy.model.preset or Path(str(rt.model_path)).name
        self.tasks = frozenset(rt.supported_tasks)  # every runtime kind says what its checkpoint can do
        self.video_defaults = _defaults(rt, TaskType.T2V if TaskType.T2V in self.tasks else TaskType.I2V)
        cfg = getattr(rt.model, "config", None) or {}
        ts = cfg.get("vae_scale_temporal") if isinstance(cfg, dict) else None
        self.temporal_scale = int(ts) if isinstance(ts, int) else None

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the preparation threads (the event loop stays free)."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, fn, *args)

    def track(self, handles: list[Any]) -> None:
        """Let the drain wait for (then cancel) these engine requests; each is dropped when it ends."""
        for h in handles:
            self.requests[h.request_id] = h
            fut = asyncio.ensure_future(h.result())
            fut.add_done_callback(lambda _f, rid=h.request_id: self.requests.pop(rid, None))

    def pressure(self) -> dict[str, Any]:
        """What is scarce now: stream sessions held by WebSockets, and the causal KV pools' free
        slabs (``/health`` and ``/metrics`` show it; a full pool answers 429 / a WS ``error``)."""
        out: dict[str, Any] = {}
        if self.cost_budget is not None:
            out["cost"] = {"in_flight": self.cost_budget.in_flight, "max": self.cost_budget.limit}
        slots = getattr(self, "ws_sessions", None)
        if slots is not None:
            out["sessions"] = {"open": slots.open, "max": slots.cap, "per_client": slots.per_client}
        model = getattr(self.runtime, "model", None)
        dep = (getattr(model, "config", None) or {}).get("causal") if model is not None else None
        pools = getattr(dep, "pools", None)
        if callable(pools):
            try:
                stats = [p.stats() for p in pools()]
                out["kv"] = {"pools": len(stats), "free_blocks": sum(int(st.get("free_blocks", 0)) for st in stats),
                             "num_blocks": sum(int(st.get("num_blocks", 0)) for st in stats)}
            except Exception:  # never let a pressure probe fail /health
                log.debug("kv pressure probe failed", exc_info=True)
        return out

    def count_status(self, status: int) -> None:
        if status >= 400:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def check_model(self, body: Any) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name not in (self.model_id, self.runtime.family.name):
            raise RequestError("model", f"unknown model {show(name)}; this server serves {self.model_id!r}")

    # -- shutdown ---------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Start draining now (called on SIGTERM/SIGINT by ``omniloop serve``); idempotent."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(), name="omniloop-drain")

    async def drain(self) -> None:
        """Stop admitting; finish in-flight jobs within ``shutdown_timeout``, cancel the rest; record all."""
        self.begin_drain()
        assert self._drain_task is not None
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        self.draining = True  # create_video / create_images answer 503 from now on
        grace = self.shutdown_timeout
        n = len(self.jobs.in_flight()) + len(self.requests)
        self.jobs.shutdown_reason = f"the server shut down (it waits {grace:g} s for running jobs)"
        if n:
            log.warning("shutting down: %d job(s) in flight; finishing them for up to %g s, then cancelling", n, grace)
        await self._wait_jobs(grace)  # finishing includes writing the mp4
        for job in self.jobs.in_flight():
            self.engine.cancel(job.id)  # lands at the job's next step boundary
        for rid in list(self.requests):
            self.engine.cancel(rid)
        await self._wait_jobs(STOP_GRACE_S + WRITE_GRACE_S)
        stuck = [j for j in self.jobs.in_flight() if j.task is not None and not j.task.done()]
        for job in stuck:  # never leave a job unrecorded: its follower records it as it stops
            job.final_status = "cancelled"
            job.error = {"code": "cancelled", "message": f"cancelled: {self.jobs.shutdown_reason}; "
                         "its last step or output write did not end in time"}
            job.task.cancel()  # type: ignore[union-attr]
        stuck_requests = [h for h in self.requests.values() if not h.done()]
        if stuck:
            await asyncio.wait([j.task for j in stuck if j.task is not None], timeout=1.0)
        if stuck or stuck_requests:
            # the compute thread is inside a step that does not end: leave it (a daemon thread)
            # rather than block the exit on joining it; its requests are answered (503) now
            log.warning("shutting down: %d request(s) still inside a step after the grace period; abandoned",
                        len(stuck) + len(stuck_requests))
            await self.engine.shutdown(drain=False, timeout=0.5)
        else:
            await self.engine.shutdown(drain=False, timeout=STOP_GRACE_S)
        (log.warning if n else log.info)("shut down: jobs %s; final states in %s", self.jobs.counts(),
                                         self.jobs.output_dir / "jobs.jsonl")

    async def _wait_jobs(self, timeout: float) -> None:
        tasks: list[Any] = [j.task for j in self.jobs.in_flight() if j.task is not None and not j.task.done()]
        tasks += [asyncio.ensure_future(h.result()) for h in self.requests.values() if not h.done()]
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)


def _defaults(rt: Any, task: TaskType) -> dict[str, Any]:
    """The family's defaults for ``task`` (``Runtime.defaults``; none for a runtime without it)."""
    fn = getattr(rt, "defaults", None)
    try:
        return dict(fn(task)) if callable(fn) else {}
    except Exception:  # a family whose task_defaults fails: no defaults (the request still validates)
        return {}


class _Guard:
    """Outermost ASGI layer: counts error statuses; turns an exception nobody handled into a 500 in
    OpenAI's shape instead of letting it reach uvicorn (which would drop the keep-alive connection);
    answers a request body that stalls longer than ``server.body_timeout_s`` with 408 (uvicorn's
    header timeout covers only the headers)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = timed_out = False
        body_done = scope.get("method") in ("GET", "HEAD")  # no body to wait for
        body_timeout = self.state.options.body_timeout_s

        async def _receive() -> Any:
            # While the body streams in, each chunk must arrive within body_timeout_s; a stalled
            # body reads as a disconnect to the app (its request is dropped, nothing queued) and
            # is answered 408 below. Once the body is complete, receive() is unbounded again: it
            # then waits for a real disconnect, which endpoints watch (disconnect = cancel).
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), body_timeout)
            except TimeoutError:
                timed_out = body_done = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def _send(message: Any) -> None:
            nonlocal started, finished
            if timed_out and not started:
                return  # the app's answer to the "disconnect": the 408 below goes out instead
            if message["type"] == "http.response.start":
                started = True
                self.state.count_status(int(message["status"]))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        async def _stalled() -> None:
            nonlocal timed_out
            timed_out = False  # let the 408 through _send
            resp = error(408, f"the request body stalled for more than {body_timeout:g} s (server.body_timeout_s)",
                         type_="invalid_request_error", code="body_timeout", headers={"Connection": "close"})
            await resp(scope, receive, _send)

        try:
            await self.app(scope, _receive, _send)
        except Exception as exc:
            if timed_out and not started:
                await _stalled()
                return
            self.state.unhandled_errors += 1
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if finished:
                return  # the 500 went out already (Starlette's handler): keep the connection
            if started:
                raise  # half a response: only closing the connection is honest
            resp = error(500, f"internal server error ({type(exc).__name__})", type_="server_error")
            await resp(scope, receive, _send)
            return
        if timed_out and not started:
            await _stalled()


class _HttpError(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def create_app(
    runtime: Any,
    *,
    output_dir: str | Path | None = None,
    scheduler: str | None = None,
    engine_options: dict[str, Any] | None = None,
    max_finished_jobs: int = 1000,
    shutdown_timeout: float = 30.0,
    poll_after_ms: int = 500,
    route_extensions: Mapping[str, Any] | None = None,
    server_options: dict[str, Any] | ServerOptions | None = None,
    public_url: str | None = None,
) -> Starlette:
    """A Starlette app serving ``runtime`` through an :class:`AsyncEngine` started with the app.

    ``app.state.omniloop`` is the :class:`ServerState`. ``shutdown_timeout``: seconds in-flight jobs
    may still finish when the server stops (then they are cancelled). ``poll_after_ms``: the
    ``openai-poll-after-ms`` hint the SDK's ``poll()`` follows. ``route_extensions``: ``{name:
    routes(api)}`` mounted after the built-in routes (:mod:`.extensions`; ``omniloop serve`` passes
    the installed ones). ``server_options``: the deploy's ``server:`` section
    (:class:`.options.ServerOptions`), overridden key by key. ``public_url``: the base of the
    ``url`` answers (``response_format: "url"``); without it, the address of the socket a request
    came in on — never the client's ``Host`` header.
    """
    refuse_in_process(runtime.deploy)
    raw_options = dict(getattr(runtime.deploy, "server", None) or {})
    if isinstance(server_options, ServerOptions):
        options = server_options
    else:
        options = parse_server_options({**raw_options, **(server_options or {})})
    sched = scheduler or (runtime.deploy.scheduler if runtime.deploy.scheduler in ("step", "serial") else "step")
    engine = AsyncEngine(runtime, sched, **(engine_options or {}))
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="omniloop-jobs-"))
    out.mkdir(parents=True, exist_ok=True)
    state = ServerState(engine, out, max_finished_jobs, shutdown_timeout, poll_after_ms, options)
    state.public_url = public_url.rstrip("/") if public_url else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        if options.json_process_bytes is not None:
            state.json_processes.start()
        await engine.start()
        try:
            yield
        finally:
            await state.drain()
            state.prepare_pool.shutdown(wait=False, cancel_futures=True)
            state.json_processes.close()

    def media_type(request: Request, *, form: bool) -> str:
        ct = request.headers.get("content-type", "")
        media = ct.split(";", 1)[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return "json"
        if form and media == "multipart/form-data":
            return "form"
        takes = "application/json or multipart/form-data" if form else "application/json"
        raise _HttpError(error(415, f"Content-Type must be {takes}, got {show(ct) if ct else 'none'}",
                               type_="invalid_request_error", param="Content-Type", code="unsupported_media_type"))

    async def read_body(request: Request, limit: int) -> list[bytes]:
        """The body's chunks as they came, up to ``limit`` bytes (413 beyond). Never joined here: one
        30 MB ``bytes`` built on the event loop stalled it for 70-90 ms (a fresh allocation's page
        faults) — the parsers join or stream them in a preparation thread or a helper process."""
        declared = request.headers.get("content-length", "")
        too_large = f"body larger than {limit} bytes (this endpoint's limit; deploy server.max_body_bytes / max_text_body_bytes)"
        if declared.isdigit() and int(declared) > limit:
            raise _HttpError(error(413, too_large, type_="invalid_request_error"))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _HttpError(error(413, too_large, type_="invalid_request_error"))
            chunks.append(chunk)
        return chunks

    # the longest string a body may hold: text up to max_text_chars (all of one request's text), an
    # image's base64 (or data: URL) up to MAX_IMAGE_BYTES decoded
    string_caps = StringCaps(options.max_text_chars, 4 * -(-MAX_IMAGE_BYTES // 3) + 256)

    async def read_json(request: Request, limit: int, *, check: bool = True) -> Any:
        """A JSON body whatever its Content-Type (for route extensions and admin routes: ComfyUI's
        clients often send none), read up to ``limit`` bytes (:class:`.bodies.BodyTooLarge` beyond)
        and parsed off the event loop (:class:`RequestError` path ``body`` when unreadable)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        return await state.off_loop(lambda: parse_json(chunks, state.json_processes, options.json_process_bytes,
                                                       check=check))

    async def read_request_body(request: Request, *, form: bool, text: bool = False) -> Any:
        """The body as JSON (or a multipart form): read up to the endpoint's limit (``text``: the
        chat/completions limit), parsed in a preparation thread."""
        kind = media_type(request, form=form)
        raw = await read_body(request, options.max_text_body_bytes if text else options.max_body_bytes)
        try:
            if kind == "json":
                return await state.off_loop(lambda: parse_json(raw, state.json_processes, options.json_process_bytes,
                                                               caps=string_caps))
            return await parse_form(request, raw)
        except RequestError as exc:
            if exc.path == "body":  # the body could not be read at all
                raise _HttpError(error(400, exc.message, type_="invalid_request_error", param="body",
                                       code="invalid_body")) from None
            raise

    async def parse_form(request: Request, raw: list[bytes]) -> Any:
        # python-multipart is pure Python (0.6 s for a 30 MB form on a busy core): in a preparation
        # thread, on that thread's own event loop, never on the server's
        headers = request.headers
        return await state.off_loop(lambda: asyncio.run(_parse_form(headers, raw)))

    async def _parse_form(headers: Any, raw: list[bytes]) -> Any:
        from starlette.formparsers import MultiPartParser

        async def stream() -> AsyncIterator[bytes]:
            for chunk in raw:
                yield chunk
            yield b""

        try:
            form = await MultiPartParser(headers, stream(), max_files=MAX_FORM_FILES, max_fields=64,
                                         max_part_size=options.max_body_bytes).parse()  # a base64 image may be a text field
        except Exception as exc:  # python-multipart's and Starlette's errors alike
            raise RequestError("body", f"malformed multipart/form-data body: {show(getattr(exc, 'message', str(exc)), 200)}") from None
        try:
            items: list[tuple[str, Any]] = []
            for key, value in form.multi_items():
                items.append((key, await value.read() if isinstance(value, UploadFile) else value))
        finally:
            await form.close()
        body = form_to_body(items)
        check_tree(body)
        return body

    def check_sizes(mapped: MappedBody) -> None:
        """Limits on work proportional to the input, before it is done (in a preparation thread)."""
        check_texts(mapped.requests, options)
        check_image_use(mapped.requests)
        check_images(mapped.requests, state.max_image_pixels)

    # cost-aware admission: the request's own cost (server.max_request_cost), room in the KV pool
    # (server.kv_full), then the cost of everything in flight (server.max_inflight_cost), reserved last
    budget = state.cost_budget
    admit = admission_check(cost_check(options.max_request_cost), kv_room_check(options),
                            budget.check if budget is not None else None)

    async def submit(mapped: MappedBody) -> list[Any]:
        """Queue the body's requests (all or nothing); their preparation runs off the event loop."""
        await state.off_loop(check_sizes, mapped)
        handles = []
        try:
            for r in mapped.requests:
                handles.append(await _submit_one(r))
        except BaseException:
            for h in handles:  # all or nothing
                engine.cancel(h.request_id)
            raise
        return handles

    async def _submit_one(r: dict[str, Any]) -> Any:
        try:
            handle = await engine.submit_async(r, state.prepare_pool, check=admit)
        except (RequestError, AdmissionRefused, QueueFull, EngineClosed, NoRoom):
            if budget is not None and isinstance(r.get("request_id"), str):
                budget.release(r["request_id"])  # reserved by the check, then not queued
            raise
        except Exception as exc:  # validation raised something else: still the request's fault
            log.warning("validating request %s raised %s", r.get("request_id"), type(exc).__name__, exc_info=True)
            raise RequestError("body", f"invalid request ({type(exc).__name__}: {show(str(exc), 200)})") from None
        if budget is not None:  # its cost comes back when it ends, however it ends
            asyncio.ensure_future(handle.result()).add_done_callback(
                lambda _f, rid=handle.request_id: budget.release(rid))
        return handle

    def translate(exc: Exception, mapped: MappedBody | None) -> Response:
        if isinstance(exc, _HttpError):
            return exc.response
        if isinstance(exc, ClientDisconnect):
            return Response(status_code=400)
        if isinstance(exc, AdmissionRefused):
            return error(422, str(exc.message), type_="invalid_request_error", param="size", code="too_large")
        if isinstance(exc, RequestError):
            if isinstance(exc, InvalidBody):  # refused by the body's schema: never reached the engine
                state.invalid_bodies += 1
            param = mapped.body_path(exc.path) if mapped is not None else (exc.path or "body")
            return error(422, exc.message, type_="invalid_request_error", param=param)
        if isinstance(exc, QueueFull):
            return error(429, str(exc), type_="rate_limit_error", code="queue_full",
                         headers={"Retry-After": str(options.retry_after_s)})
        if isinstance(exc, NoRoom):
            return error(429, exc.message, type_="rate_limit_error", code=exc.code,
                         headers={"Retry-After": str(exc.retry_after_s)})
        if isinstance(exc, EngineClosed):
            return error(503, str(exc), type_="server_error", code="shutting_down")
        log.warning("mapping a request body raised %s", type(exc).__name__, exc_info=True)
        return error(422, f"invalid request ({type(exc).__name__}: {show(str(exc), 200)})",
                     type_="invalid_request_error", param="body")

    def refuse_sessions(mapped: MappedBody) -> None:
        """Causal sessions are made only where their id is returned (the WebSocket): a POST can
        neither keep one (nobody would learn its id) nor continue one (it is bound to its socket)."""
        for r in mapped.requests:
            rollout = (r.get("node_params") or {}).get("rollout")
            if isinstance(rollout, dict):
                for key in ("keep_session", "session"):
                    if key in rollout and rollout[key] not in (None, False):
                        raise RequestError(f"node_params.rollout.{key}",
                                           "sessions are kept and continued over WS /v1/videos/stream only "
                                           "(a 'continue' message); POST /v1/videos runs one-off videos")

    def closed() -> Response:
        return error(503, "the server is shutting down and takes no new jobs", type_="server_error", code="shutting_down")

    def replay(job: Job) -> Response:
        return JSONResponse(job.to_dict(), status_code=200, headers={"Idempotent-Replayed": "true"})

    async def create_video(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        claimed = False
        if key is not None:  # a retried POST (the SDK's extra_headers) answers the job it made, not a new one
            if not 1 <= len(key) <= 256:
                return error(422, "Idempotency-Key: 1 to 256 characters", type_="invalid_request_error",
                             param="Idempotency-Key")
            if key in state.idempotent:
                if state.idempotent[key] is None:
                    return error(409, "a request with this Idempotency-Key is being accepted; retry it",
                                 type_="invalid_request_error", param="Idempotency-Key", code="idempotency_in_progress")
            else:
                state.idempotent[key] = None
                claimed = True
                while len(state.idempotent) > MAX_IDEMPOTENCY_KEYS:
                    state.idempotent.popitem(last=False)
        response = await _create_video(request, key)
        if claimed:
            job_id = json.loads(response.body).get("id") if response.status_code == 200 else None
            if job_id is None:
                state.idempotent.pop(key, None)  # refused: a retry is a new attempt
            else:
                state.idempotent[key] = job_id
        return response

    async def _create_video(request: Request, key: str | None) -> Response:
        mapped = None
        try:
            body = await read_request_body(request, form=True)
            if state.draining:
                return closed()
            fingerprint = await state.off_loop(body_fingerprint, body)
            earlier = state.jobs.get(state.idempotent.get(key) or "") if key is not None else None
            if earlier is not None:  # the key made a job: the same body is a retry, another is a mistake
                if earlier.fingerprint != fingerprint:
                    raise RequestError("Idempotency-Key", f"this key made job {earlier.id} with another body; "
                                                          "use a new key for a new request")
                return replay(earlier)
            mapped = await state.off_loop(lambda: map_video_body(
                body, tasks=state.tasks, defaults=state.video_defaults, temporal_scale=state.temporal_scale,
                model=repr(state.model_id)))
            state.check_model(body)
            refuse_sessions(mapped)
            rid = mapped.requests[0]["request_id"]
            if state.jobs.used(rid):
                known = state.jobs.get(rid)
                if known is not None and known.fingerprint == fingerprint:
                    return replay(known)  # a retry with the same request id and body: the job it made
                raise RequestError("request_id", "a job with this id exists or existed on this server "
                                                 "(ids are never reused, also after a restart)")
            (handle,) = await submit(mapped)
        except Exception as exc:
            return translate(exc, mapped)
        info = {"size": f"{state.video_defaults.get('width', 0)}x{state.video_defaults.get('height', 0)}", **mapped.info}
        if "seconds" not in info:
            d = handle.request.diffusion
            frames = d.frames or state.video_defaults.get("frames") or 1
            fps = d.fps or state.video_defaults.get("fps") or 16.0
            info["seconds"] = f"{frames / fps:g}"
        if "size" not in mapped.info:
            d = handle.request.diffusion
            if d.width and d.height:
                info["size"] = f"{d.width}x{d.height}"
        job = Job(handle, model=state.model_id, info=info)
        job.fingerprint = fingerprint
        state.jobs.add(job, engine)
        return JSONResponse(job.to_dict(), status_code=200)

    def with_job(handler: Callable[[Request, Job], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """The route that finds the job named by the path's ``video_id`` (404 if none) and runs
        ``handler(request, job)``."""

        async def route(request: Request) -> Response:
            job = state.jobs.get(request.path_params["video_id"])
            if job is None:
                return error(404, f"no video job {show(request.path_params['video_id'])}",
                             type_="invalid_request_error", param="video_id", code="not_found")
            return await handler(request, job)

        return route

    @with_job
    async def get_video(request: Request, job: Job) -> Response:
        headers = {} if job.terminal else {"openai-poll-after-ms": str(state.poll_after_ms)}
        return JSONResponse(job.to_dict(), headers=headers)

    async def list_videos(request: Request) -> Response:
        q = request.query_params
        limit_s = q.get("limit", "20")
        if not limit_s.isdigit() or not 1 <= int(limit_s) <= 100:
            return error(422, f"limit: expected an integer from 1 to 100, got {show(limit_s)}",
                         type_="invalid_request_error", param="limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            return error(422, f"order: expected \"asc\" or \"desc\", got {show(order)}", type_="invalid_request_error", param="order")
        jobs = list(state.jobs.jobs.values())
        if order == "desc":
            jobs.reverse()
        after = q.get("after")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                return error(404, f"no video job {show(after)} (the after cursor)", type_="invalid_request_error",
                             param="after", code="not_found")
            jobs = jobs[ids.index(after) + 1:]
        limit = int(limit_s)
        page = jobs[:limit]
        return JSONResponse({
            "object": "list", "data": [j.to_dict() for j in page],
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
            "has_more": len(jobs) > limit,
        })

    @with_job
    async def video_content(request: Request, job: Job) -> Response:
        variant = request.query_params.get("variant", "video")
        if variant not in VARIANTS:
            return error(422, f"variant: expected one of {', '.join(VARIANTS)}, got {show(variant)}",
                         type_="invalid_request_error", param="variant")
        if job.status != "completed" or job.path is None:
            if job.status == "cancelled":
                why = f"video {job.id} was cancelled; it has no content"
            elif job.status == "failed":
                why = f"video {job.id} failed; it has no content ({(job.error or {}).get('message', 'no detail')})"
            else:
                why = f"video {job.id} is {job.status}; its content is available once it completed"
            return error(409, why, type_="invalid_request_error", code=f"video_{job.status}",
                         headers={"x-should-retry": "false"})
        path = job.path if variant == "video" else job.path.with_suffix(f".{variant}.png")
        if not path.is_file():
            return error(404, f"video {job.id} has no {variant}", type_="invalid_request_error", param="variant",
                         code="not_found")
        ext = "mp4" if variant == "video" else f"{variant}.png"
        return FileResponse(path, media_type=VARIANTS[variant], filename=f"{job.id}.{ext}")

    @with_job
    async def cancel_video(request: Request, job: Job) -> Response:
        job.request_cancel(engine)
        return JSONResponse(job.to_dict())

    @with_job
    async def delete_video(request: Request, job: Job) -> Response:
        job.request_cancel(engine)
        state.jobs.remove(job.id)
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    @with_job
    async def video_events(request: Request, job: Job) -> Response:

        async def stream() -> AsyncIterator[bytes]:
            i = 0
            while True:
                changed = job.changed
                while i < len(job.events):
                    name, data = job.events[i]
                    i += 1
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                    if name == "done":
                        return
                try:
                    await asyncio.wait_for(changed.wait(), SSE_KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def create_images(request: Request) -> Response:
        mapped = None
        try:
            body = await read_request_body(request, form=False)
            if state.draining:
                return closed()
            mapped = await state.off_loop(lambda: map_image_body(body, tasks=state.tasks, model=repr(state.model_id)))
            state.check_model(body)
            handles = await submit(mapped)
        except Exception as exc:
            return translate(exc, mapped)
        state.track(handles)
        return await images_response(engine, handles, mapped, state=state, base_url=base_url(request, state),
                                     request=request)

    def model_object() -> dict[str, Any]:
        rt = state.runtime
        return {
            "id": state.model_id, "object": "model", "created": int(state.started_at), "owned_by": "omniloop",
            "family": rt.family.name, "tasks": sorted(t.value for t in state.tasks),
            "limits": {k: getattr(rt.deploy.limits, k) for k in ("max_steps", "max_frames", "max_height", "max_width", "max_queue")},
            "plugins": sorted(rt.components_enabled),
            # LoRA adapters requests may name (omniloop-adapters): names and shapes, never server paths
            "adapters": [{k: v for k, v in r.items() if k != "path"}
                         for r in (rt.adapters.describe() if getattr(rt, "adapters", None) is not None else [])],
        }

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in (state.model_id, state.runtime.family.name):
            return error(404, f"no model {show(name)}; this server serves {state.model_id!r}",
                         type_="invalid_request_error", param="model", code="model_not_found")
        return JSONResponse(model_object())

    spec = openapi_document()  # generated from the request schema's attrs classes and the body field sets
    page = docs_page()

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(spec)

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    async def health(request: Request) -> Response:
        s = engine.stats()
        ok = engine.worker_error is None and engine.accepting and not state.draining
        return JSONResponse({
            "status": "ok" if ok else ("draining" if state.draining else "unavailable"), "model": state.model_id,
            "scheduler": engine.scheduler, "queue_depth": s["waiting"], "running": s["running"],
            **state.pressure(),
        }, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(render_metrics(engine.stats(), state), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        return error(exc.status_code, str(exc.detail), type_="invalid_request_error", code=code)

    async def server_error(request: Request, exc: Exception) -> Response:
        return error(500, f"internal server error ({type(exc).__name__})", type_="server_error")

    routes = [
        Route("/v1/videos", create_video, methods=["POST"]),
        Route("/v1/videos", list_videos, methods=["GET"]),
        Route("/v1/videos/{video_id}", get_video, methods=["GET"]),
        Route("/v1/videos/{video_id}", delete_video, methods=["DELETE"]),
        Route("/v1/videos/{video_id}/cancel", cancel_video, methods=["POST"]),
        Route("/v1/videos/{video_id}/content", video_content, methods=["GET"]),
        Route("/v1/videos/{video_id}/events", video_events, methods=["GET"]),
        Route("/v1/images/generations", create_images, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
    ]
    # endpoints kept in their own modules, built on these helpers
    api = _Helpers(state=state, engine=engine, read_request_body=read_request_body, read_json=read_json, submit=submit,
                   translate=translate, closed=closed, options=options)
    routes += [*text_routes(api), *image_edit_routes(api), *video_stream_routes(api), *audio_routes(api)]
    routes += admin_routes(api)  # post-training admin routes: only with the deploy's admin.token_env
    routes = mount(routes, route_extensions, api)  # plugins' routes (omniloop.server_routes)
    app = _App(routes=routes, lifespan=lifespan,
               exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.omniloop = state
    return app


class _Helpers:
    """What endpoint modules (:mod:`.chat`, :mod:`.images`) use of :func:`create_app`'s closure."""

    def __init__(self, **helpers: Any) -> None:
        self.__dict__.update(helpers)


class _App(Starlette):
    """Starlette with :class:`_Guard` outside its whole middleware stack."""

    def build_middleware_stack(self) -> Any:
        return _Guard(super().build_middleware_stack(), self.state.omniloop)

