"""Audio endpoints: a ``t2a`` deployment (Stable Audio, the toy-audio test family) over HTTP.

=============================================  =====================================================
``POST /v1/audio/speech``                      OpenAI's shape (``model``, ``input`` = the prompt,
                                               ``response_format``; ``extra_body``: ``seconds``,
                                               ``start``, ``steps``, ``guidance``, ``seed``,
                                               ``negative_prompt``, ``omniloop``); waits and answers
                                               the file's bytes, so ``openai.OpenAI(...).audio.
                                               speech.create(...)`` works unchanged
``POST /v1/audio/generations``                 the same request as a job (``prompt`` instead of
                                               ``input``; ``response_format`` default ``wav``) →
                                               ``{id, object: "audio.generation", status, ...}``
``GET /v1/audio/generations/{id}``             its status and progress (``openai-poll-after-ms``)
``GET /v1/audio/generations/{id}/content``     the file; 409 until the job completed
``POST /v1/audio/generations/{id}/cancel``     cancel it (its record stays)
``DELETE /v1/audio/generations/{id}``          delete it (cancelling it first if it still runs)
=============================================  =====================================================

Formats (:data:`omniloop_io.media.AUDIO_ENCODINGS`): ``wav`` and ``flac`` (16-bit PCM), ``mp3``,
``opus`` (Ogg Opus; decoders report 48 kHz), ``aac`` (ADTS), ``pcm`` (raw 16-bit little-endian,
channels interleaved, at the model's rate). Every answer carrying audio names its rate and channels
in the ``X-Sample-Rate`` and ``X-Channels`` headers (what ``pcm`` needs to be played).

Bad input is a 422 naming the body field before any compute: a ``seconds`` that is not a number
> 0 (or is non-finite: ``1e999``), longer than the checkpoint's maximum (the family's check, reported
as ``seconds``), a ``response_format`` not in the list, ``speed`` other than 1, ``instructions``,
a server that does not do ``t2a`` (``model``). ``voice`` — required by OpenAI's SDK — is accepted
and has no effect (a text-to-audio model has no voices). A JSON ``NaN`` literal is not JSON: 400,
as on every endpoint.

Jobs live in memory (the newest ``max_finished_jobs`` finished ones are kept, with their files in
``<output folder>/audio/``, named by a server-made id); unlike video jobs they are not listed again
after a restart, and the files of an earlier run are deleted when the server starts. Jobs and
speech requests still running at shutdown get the drain's grace period, then are cancelled.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from omniloop.errors import RequestError
from omniloop.request import Status, TaskType

from .bodies import MappedBody, _apply_omniloop, _set, show
from .body_schema import AudioBody, AudioGenerationCreate, SpeechCreate, alias_values, parse_body
from .images import wait_all
from .jobs import BaseJob, FinishedJobs

#: the speech endpoint's default format (OpenAI's) and the job endpoint's
SPEECH_DEFAULT_FORMAT, JOB_DEFAULT_FORMAT = "mp3", "wav"
#: file suffix of each format's job content
SUFFIXES = {"wav": "wav", "flac": "flac", "mp3": "mp3", "opus": "ogg", "aac": "aac", "pcm": "pcm"}
AUDIO_FILE = re.compile(r"^[0-9a-f]{32}\.(wav|flac|mp3|ogg|aac|pcm)$")


def map_audio_body(body: Any, cls: type, *, tasks: frozenset[TaskType], model: str = "this model") -> MappedBody:
    """A speech or audio-generation body → one ``t2a`` request dict (``info``: its response format)."""
    b = parse_body(body, cls)
    speech = cls is SpeechCreate
    prompt_field = "input" if speech else "prompt"
    prompt = b.input if speech else b.prompt
    if TaskType.T2A not in tasks:
        does = ", ".join(sorted(t.value for t in tasks)) or "nothing"
        raise RequestError("model", f"{model} does not make audio (no t2a task; it does: {does})")
    d: dict[str, Any] = {"task": TaskType.T2A.value, "request_id": f"audio_{uuid.uuid4().hex[:24]}", "prompt": prompt}
    origins: dict[str, str] = {"inputs": prompt_field, "prompt": prompt_field, "task": "model"}
    if b.negative_prompt is not None:
        d["negative_prompt"] = b.negative_prompt
        origins["negative_prompt"] = "negative_prompt"
    for name, target, value in alias_values(b):
        _set(d, target, value)
        origins[target] = name
    _apply_omniloop(body, d, origins)
    fmt = b.response_format or (SPEECH_DEFAULT_FORMAT if speech else JOB_DEFAULT_FORMAT)
    info: dict[str, Any] = {"prompt": prompt, "response_format": fmt}
    return MappedBody([d], origins, info)


def _encode(out: Any, fmt: str) -> tuple[bytes, int, int]:
    """The output's ``audio`` artifact encoded as ``fmt``: (bytes, sample rate, channels)."""
    from omniloop.artifacts import Audio
    from omniloop_io.media import encode_audio

    art = out.artifacts.get("audio")
    if not isinstance(art, Audio):
        raise ValueError("the pipeline produced no audio")
    return encode_audio(art.samples, int(art.sample_rate), fmt), int(art.sample_rate), int(art.samples.shape[0])


def _audio_headers(rate: int, channels: int) -> dict[str, str]:
    return {"X-Sample-Rate": str(rate), "X-Channels": str(channels)}


class AudioJob(BaseJob):
    """An audio generation job (``object: "audio.generation"``), in memory only."""

    def __init__(self, handle: Any, *, model: str, info: dict[str, Any]) -> None:
        super().__init__(handle, model=model, info=info)
        self.sample_rate: int | None = None
        self.channels: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id, "object": "audio.generation", "model": self.model, "status": self.api_status,
            "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
            "error": self.error, **self.info,
        }
        if self.sample_rate is not None:
            d["sample_rate"], d["channels"] = self.sample_rate, self.channels
        if self.metrics:
            d["metrics"] = self.metrics
        if self.cancel_requested and not self.terminal:
            d["cancel_requested"] = True
        return d


class AudioJobs(FinishedJobs[AudioJob]):
    """Audio jobs by id, in memory; at most ``max_finished`` finished ones (oldest evicted with their files)."""

    def __init__(self, folder: Path, max_finished: int) -> None:
        super().__init__(max_finished)
        self.folder = Path(folder).resolve()  # made with the first job's file
        if self.folder.is_dir():
            for old in self.folder.iterdir():  # an earlier run's jobs are not listed again: their files go
                if AUDIO_FILE.match(old.name):
                    old.unlink(missing_ok=True)

    def path_for(self, fmt: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = (self.folder / f"{uuid.uuid4().hex}.{SUFFIXES[fmt]}").resolve()
        if path.parent != self.folder:  # never expected: the name is ours
            raise OSError(f"{path} is not in {self.folder}")
        return path


def audio_routes(api: Any) -> list[Any]:
    """The audio routes on the app's helpers (see :func:`omniloop_server.app.create_app`)."""
    from .app import error

    state, engine = api.state, api.engine
    jobs = AudioJobs(Path(state.jobs.output_dir) / "audio", state.jobs.max_finished)
    state.audio_jobs = jobs

    async def prepare(request: Request, cls: type) -> tuple[MappedBody | None, Any]:
        """The body read, mapped and submitted: ``(mapped, handle)``, or ``(mapped, error response)``."""
        mapped = None
        try:
            body = await api.read_request_body(request, form=False)
            if state.draining:
                return None, api.closed()
            mapped = await state.off_loop(lambda: map_audio_body(body, cls, tasks=state.tasks,
                                                                 model=repr(state.model_id)))
            state.check_model(body)
            (handle,) = await api.submit(mapped)
        except Exception as exc:
            return mapped, api.translate(exc, mapped)
        return mapped, handle

    async def speech(request: Request) -> Response:
        mapped, handle = await prepare(request, SpeechCreate)
        if isinstance(handle, Response):
            return handle
        assert mapped is not None
        state.track([handle])
        (out,) = await wait_all(engine, [handle], request)
        engine.forget(handle.request_id)
        if not out.ok:
            msg = out.error.message if out.error else out.status.value
            if state.draining:
                return error(503, f"audio generation {out.status.value}: the server is shutting down ({msg})",
                             type_="server_error", code="shutting_down")
            return error(500, f"audio generation {out.status.value}: {msg}", type_="server_error", code=out.status.value)
        fmt = mapped.info["response_format"]
        try:
            data, rate, channels = await asyncio.to_thread(_encode, out, fmt)
        except Exception as exc:
            return error(500, f"encoding the audio failed: {exc}", type_="server_error")
        from omniloop_io.media import AUDIO_ENCODINGS

        return Response(data, media_type=AUDIO_ENCODINGS[fmt].media_type, headers=_audio_headers(rate, channels))

    async def follow(job: AudioJob) -> None:
        h = job.handle
        try:
            out = await h.result()
            job.keep_metrics(out)
            if out.status is Status.COMPLETED:
                fmt = job.info["response_format"]
                data, rate, channels = await asyncio.to_thread(_encode, out, fmt)
                if not job.deleted:
                    path = jobs.path_for(fmt)
                    tmp = path.with_name(f".{path.name}.tmp")
                    await asyncio.to_thread(tmp.write_bytes, data)
                    tmp.replace(path)
                    job.path = path
                job.sample_rate, job.channels = rate, channels
                job.final_status = "completed"
            else:
                job.settle_unfinished(out, "cancelled (the server shut down)" if state.draining else None)
        except Exception as exc:  # never leave a job non-terminal
            job.fail(exc)
        finally:
            job.release(h, engine)
            jobs.evict()

    async def create(request: Request) -> Response:
        mapped, handle = await prepare(request, AudioGenerationCreate)
        if isinstance(handle, Response):
            return handle
        assert mapped is not None
        info = {"prompt": mapped.info["prompt"], "response_format": mapped.info["response_format"]}
        window = handle.request.audio
        if window is not None:
            info["start"] = window.start
            if window.seconds is not None:
                info["seconds"] = window.seconds
        job = AudioJob(handle, model=state.model_id, info=info)
        jobs.jobs[job.id] = job
        state.track([handle])
        job.task = asyncio.create_task(follow(job), name=f"audio-job-{job.id}")
        return JSONResponse(job.to_dict())

    def find(request: Request) -> AudioJob | Response:
        job = jobs.jobs.get(request.path_params["job_id"])
        if job is None:
            return error(404, f"no audio job {show(request.path_params['job_id'])}", type_="invalid_request_error",
                         param="job_id", code="not_found")
        return job

    async def get(request: Request) -> Response:
        job = find(request)
        if isinstance(job, Response):
            return job
        headers = {} if job.terminal else {"openai-poll-after-ms": str(state.poll_after_ms)}
        return JSONResponse(job.to_dict(), headers=headers)

    async def content(request: Request) -> Response:
        job = find(request)
        if isinstance(job, Response):
            return job
        if job.status != "completed" or job.path is None or not job.path.is_file():
            why = (f"audio job {job.id} is {job.status}; its content is available once it completed" if not job.terminal
                   else f"audio job {job.id} {job.status}; it has no content ({(job.error or {}).get('message', 'no detail')})")
            return error(409, why, type_="invalid_request_error", code=f"audio_{job.status}",
                         headers={"x-should-retry": "false"})
        from omniloop_io.media import AUDIO_ENCODINGS

        fmt = job.info["response_format"]
        assert job.sample_rate is not None and job.channels is not None
        return FileResponse(job.path, media_type=AUDIO_ENCODINGS[fmt].media_type, filename=f"{job.id}.{SUFFIXES[fmt]}",
                            headers=_audio_headers(job.sample_rate, job.channels))

    async def cancel(request: Request) -> Response:
        job = find(request)
        if isinstance(job, Response):
            return job
        job.request_cancel(engine)
        return JSONResponse(job.to_dict())

    async def delete(request: Request) -> Response:
        job = find(request)
        if isinstance(job, Response):
            return job
        job.request_cancel(engine)
        jobs.remove(job.id)
        return JSONResponse({"id": job.id, "object": "audio.generation.deleted", "deleted": True})

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/audio/generations", create, methods=["POST"]),
        Route("/v1/audio/generations/{job_id}", get, methods=["GET"]),
        Route("/v1/audio/generations/{job_id}", delete, methods=["DELETE"]),
        Route("/v1/audio/generations/{job_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/audio/generations/{job_id}/content", content, methods=["GET"]),
    ]


def audio_paths() -> dict[str, Any]:
    """The audio routes' part of ``/openapi.json`` (:func:`omniloop_server.openapi.openapi_document`)."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    files = {t: binary for t in ("audio/mpeg", "audio/wav", "audio/flac", "audio/ogg", "audio/aac", "audio/pcm")}
    errors = {"default": {"description": "An error in OpenAI's shape (400 bad body, 404 unknown id, 409 not "
                                         "completed, 422 invalid field, 429 queue full, 503 shutting down)",
                          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}

    def body(name: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}

    job = {"description": "The job", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/AudioGeneration"}}}}
    jid = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/audio/speech": {"post": {
            "operationId": "createSpeech", "summary": "Text to audio (t2a), OpenAI's audio.speech shape: the file's bytes",
            "requestBody": body("SpeechCreate"),
            "responses": {"200": {"description": "The audio file (X-Sample-Rate, X-Channels headers)", "content": files},
                          **errors}}},
        "/v1/audio/generations": {"post": {
            "operationId": "createAudioGeneration", "summary": "An audio (t2a) job: poll it, then GET its content",
            "requestBody": body("AudioGenerationCreate"), "responses": {"200": job, **errors}}},
        "/v1/audio/generations/{job_id}": {
            "get": {"operationId": "getAudioGeneration", "parameters": jid, "responses": {"200": job, **errors}},
            "delete": {"operationId": "deleteAudioGeneration", "parameters": jid, "responses": {
                "200": {"description": "Deleted", "content": {"application/json": {"schema": {"type": "object"}}}},
                **errors}}},
        "/v1/audio/generations/{job_id}/cancel": {"post": {
            "operationId": "cancelAudioGeneration", "parameters": jid, "responses": {"200": job, **errors}}},
        "/v1/audio/generations/{job_id}/content": {"get": {
            "operationId": "getAudioGenerationContent", "parameters": jid,
            "responses": {"200": {"description": "The audio file", "content": files}, **errors}}},
    }


def audio_schemas() -> dict[str, Any]:
    """The reply schemas of the audio routes (the bodies come from their classes)."""
    s, i = {"type": "string"}, {"type": "integer"}
    return {"AudioGeneration": {
        "type": "object", "required": ["id", "object", "status"],
        "properties": {"id": s, "object": {"enum": ["audio.generation"]}, "model": s,
                       "status": {"enum": ["queued", "in_progress", "completed", "failed"]},
                       "progress": {"type": "integer", "minimum": 0, "maximum": 100}, "created_at": i,
                       "completed_at": {"type": ["integer", "null"]}, "response_format": s,
                       "seconds": {"type": "number"}, "start": {"type": "number"}, "sample_rate": i, "channels": i,
                       "error": {"anyOf": [{"type": "object"}, {"type": "null"}]}}}}


__all__ = ["AudioBody", "AudioJob", "AudioJobs", "audio_paths", "audio_routes", "audio_schemas", "map_audio_body"]
