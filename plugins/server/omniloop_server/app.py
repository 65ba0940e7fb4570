"""The HTTP API (Starlette), served by uvicorn.

=====================================  ===========================================================
``POST /v1/videos``                    submit a video job → ``{id, object, status, progress, ...}``
``GET /v1/videos``                     list jobs
``GET /v1/videos/{id}``                a job's status and progress
``GET /v1/videos/{id}/content``        the mp4 (404 unknown, 409 until the job completed)
``GET /v1/videos/{id}/events``         server-sent events: ``status``, ``progress``..., ``done``
``DELETE /v1/videos/{id}``             cancel a queued/running job; delete a finished one
``POST /v1/images/generations``        OpenAI-like; waits, returns ``data: [{b64_json}]`` (png)
``GET /v1/models``                     the served model
``GET /health``                        liveness + queue state (503 when the engine died)
``GET /metrics``                       Prometheus text
=====================================  ===========================================================

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; a validation
error is 422 with ``param`` the dotted body field path (``detail`` repeats it FastAPI-style).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from omniloop.errors import RequestError
from omniloop_scheduler import AdmissionRefused, AsyncEngine, EngineClosed, QueueFull
from omniloop_scheduler.models import family_defaults

from .bodies import MappedBody, map_image_body, map_video_body
from .jobs import Job, JobStore
from .metrics import render_metrics

log = logging.getLogger("omniloop.server")

MAX_BODY_BYTES = 32 * 1024 * 1024
SSE_KEEPALIVE_S = 15.0


def error(status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code or type_}}
    if status == 422:
        body["detail"] = [{"loc": ["body", *(param.split(".") if param else [])], "msg": message, "type": "value_error"}]
    return JSONResponse(body, status_code=status)


class ServerState:
    def __init__(self, engine: AsyncEngine, output_dir: Path, max_finished_jobs: int) -> None:
        self.engine = engine
        self.runtime = engine.runtime
        self.jobs = JobStore(output_dir, max_finished_jobs)
        self.started_at = time.time()
        self.http_errors: dict[int, int] = {}
        rt = self.runtime
        self.model_id = rt.deploy.model.preset or Path(str(rt.model_path)).name
        self.tasks = frozenset(rt.family.tasks)
        self.defaults = family_defaults(rt)
        cfg = getattr(rt.model, "config", None) or {}
        ts = cfg.get("vae_scale_temporal") if isinstance(cfg, dict) else None
        self.temporal_scale = int(ts) if isinstance(ts, int) else None

    def count(self, resp: Response) -> Response:
        if resp.status_code >= 400:
            self.http_errors[resp.status_code] = self.http_errors.get(resp.status_code, 0) + 1
        return resp

    def check_model(self, body: Any, mapped: MappedBody) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name not in (self.model_id, self.runtime.family.name):
            raise RequestError("model", f"unknown model {name!r}; this server serves {self.model_id!r}")


def create_app(
    runtime: Any,
    *,
    output_dir: str | Path | None = None,
    scheduler: str | None = None,
    engine_options: dict[str, Any] | None = None,
    max_finished_jobs: int = 1000,
) -> Starlette:
    """A Starlette app serving ``runtime`` through an :class:`AsyncEngine` started with the app."""
    sched = scheduler or (runtime.deploy.scheduler if runtime.deploy.scheduler in ("step", "serial") else "step")
    engine = AsyncEngine(runtime, sched, **(engine_options or {}))
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="omniloop-jobs-"))
    out.mkdir(parents=True, exist_ok=True)
    state = ServerState(engine, out, max_finished_jobs)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain=False, timeout=30.0)
            tasks = [j.task for j in state.jobs.jobs.values() if j.task is not None and not j.task.done()]
            if tasks:
                await asyncio.wait(tasks, timeout=30.0)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise _HttpError(error(413, f"body larger than {MAX_BODY_BYTES} bytes", type_="invalid_request_error"))
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _HttpError(error(422, f"body is not valid JSON: {exc}", type_="invalid_request_error", param="body")) from None

    def submit(mapped: MappedBody) -> list[Any]:
        handles = []
        try:
            for r in mapped.requests:
                handles.append(engine.submit(r))
        except BaseException:
            for h in handles:  # all or nothing
                engine.cancel(h.request_id)
            raise
        return handles

    def translate(exc: Exception, mapped: MappedBody | None) -> Response:
        if isinstance(exc, _HttpError):
            return exc.response
        if isinstance(exc, ClientDisconnect):
            return Response(status_code=400)
        if isinstance(exc, AdmissionRefused):
            return error(422, str(exc.message), type_="invalid_request_error", param="size", code="too_large")
        if isinstance(exc, RequestError):
            param = mapped.body_path(exc.path) if mapped is not None else (exc.path or "body")
            return error(422, exc.message, type_="invalid_request_error", param=param)
        if isinstance(exc, QueueFull):
            return error(429, str(exc), type_="rate_limit_error", code="queue_full")
        if isinstance(exc, EngineClosed):
            return error(503, str(exc), type_="server_error", code="shutting_down")
        raise exc

    async def create_video(request: Request) -> Response:
        mapped = None
        try:
            body = await read_json(request)
            mapped = map_video_body(body, tasks=state.tasks, defaults=state.defaults, temporal_scale=state.temporal_scale)
            state.check_model(body, mapped)
            if state.jobs.get(mapped.requests[0]["request_id"]) is not None:
                raise RequestError("request_id", "a job with this id exists (DELETE it first)")
            (handle,) = submit(mapped)
        except Exception as exc:
            return state.count(translate(exc, mapped))
        job = Job(handle, model=state.model_id, info=mapped.info)
        state.jobs.add(job, engine)
        return JSONResponse(job.to_dict(), status_code=200)

    def find(request: Request) -> Job:
        job = state.jobs.get(request.path_params["video_id"])
        if job is None:
            raise _HttpError(error(404, f"no video job {request.path_params['video_id']!r}", type_="not_found_error", param="id"))
        return job

    async def get_video(request: Request) -> Response:
        try:
            return JSONResponse(find(request).to_dict())
        except _HttpError as exc:
            return state.count(exc.response)

    async def list_videos(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [j.to_dict() for j in state.jobs.jobs.values()]})

    async def video_content(request: Request) -> Response:
        try:
            job = find(request)
        except _HttpError as exc:
            return state.count(exc.response)
        if job.status != "completed" or job.path is None:
            return state.count(error(
                409, f"video {job.id} is {job.status}; its content is available once it completed",
                type_="invalid_request_error", code=f"video_{job.status}",
            ))
        return FileResponse(job.path, media_type="video/mp4", filename=f"{job.id}.mp4")

    async def delete_video(request: Request) -> Response:
        try:
            job = find(request)
        except _HttpError as exc:
            return state.count(exc.response)
        if not job.terminal:
            job.cancel_requested = True
            engine.cancel(job.id)
            return JSONResponse(job.to_dict())
        state.jobs.remove(job.id)
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    async def video_events(request: Request) -> Response:
        try:
            job = find(request)
        except _HttpError as exc:
            return state.count(exc.response)

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
            body = await read_json(request)
            mapped = map_image_body(body, tasks=state.tasks)
            state.check_model(body, mapped)
            handles = submit(mapped)
        except Exception as exc:
            return state.count(translate(exc, mapped))
        outs = await asyncio.gather(*(h.result() for h in handles))
        for h in handles:
            engine.forget(h.request_id)
        bad = next((o for o in outs if not o.ok), None)
        if bad is not None:
            msg = bad.error.message if bad.error else bad.status.value
            return state.count(error(500, f"image generation {bad.status.value}: {msg}", type_="server_error", code=bad.status.value))
        try:
            data = await asyncio.to_thread(lambda: [{"b64_json": _png_b64(o)} for o in outs])
        except Exception as exc:
            return state.count(error(500, f"encoding the image failed: {exc}", type_="server_error"))
        return JSONResponse({"created": int(time.time()), "data": data})

    async def models(request: Request) -> Response:
        rt = state.runtime
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": int(state.started_at), "owned_by": "omniloop",
            "family": rt.family.name, "tasks": sorted(t.value for t in state.tasks),
            "limits": {k: getattr(rt.deploy.limits, k) for k in ("max_steps", "max_frames", "max_height", "max_width", "max_queue")},
            "plugins": sorted(rt.components_enabled),
        }]})

    async def health(request: Request) -> Response:
        s = engine.stats()
        ok = engine.worker_error is None and engine.accepting
        return JSONResponse({
            "status": "ok" if ok else "unavailable", "model": state.model_id, "scheduler": engine.scheduler,
            "queue_depth": s["waiting"], "running": s["running"],
        }, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(render_metrics(engine.stats(), state), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/videos", create_video, methods=["POST"]),
        Route("/v1/videos", list_videos, methods=["GET"]),
        Route("/v1/videos/{video_id}", get_video, methods=["GET"]),
        Route("/v1/videos/{video_id}", delete_video, methods=["DELETE"]),
        Route("/v1/videos/{video_id}/content", video_content, methods=["GET"]),
        Route("/v1/videos/{video_id}/events", video_events, methods=["GET"]),
        Route("/v1/images/generations", create_images, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.omniloop = state
    return app


class _HttpError(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _png_b64(out: Any) -> str:
    from omniloop.media import to_pil

    art = out.artifacts.get("image")
    pixels = art.pixels if art is not None else out.artifacts["video"].frames[0]
    buf = io.BytesIO()
    to_pil(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
