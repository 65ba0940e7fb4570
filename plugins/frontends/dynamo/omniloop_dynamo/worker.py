"""``omniloop dynamo-worker``: serve one omniloop deployment as an NVIDIA Dynamo worker.

One process = one omniloop :class:`~omniloop.runtime.Runtime` + its ``AsyncEngine`` + one Dynamo
``DistributedRuntime``. The worker

* registers ``ModelType.Videos`` on ``NAMESPACE.COMPONENT.ENDPOINT`` (t2v/i2v models) and
  ``ModelType.Images`` on ``NAMESPACE.COMPONENT.ENDPOINT_images`` (t2i/i2i models) under one
  model name, so Dynamo's frontend serves ``POST /v1/videos`` and ``POST /v1/images/generations``
  and routes across every worker that registered the name;
* maps each request onto an ``OmniRequest`` (:mod:`omniloop_dynamo.protocol`), submits it to the
  engine, and returns the mp4 / png as base64 or as a URL under ``--media-dir``;
* answers client errors with Dynamo's ``InvalidArgument`` (HTTP 400 with the message) and never
  lets a request take the worker down;
* answers the runtime's health canary without compute (it checks the engine thread is alive);
* on SIGTERM/SIGINT drains: unregisters its instance (the router stops sending), keeps serving
  what arrives during ``--grace-period``, then refuses new requests (``EngineShutdown`` -> 503,
  the frontend marks the instance down), finishes what is queued and running (at most
  ``--drain-timeout`` seconds, then cancels the rest), unregisters the model and exits 0;
* appends its metrics (queue, predicted per-request cost, outstanding predicted seconds) to the
  Dynamo system server's ``/metrics`` (``--system-port``), and publishes the model's tasks,
  limits and cost-model state in the model card (``runtime_config.runtime_data.omniloop``).

Run it as ``omniloop dynamo-worker --deploy deploy.yaml`` or ``python -m omniloop_dynamo.worker``.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click
from attrs import define, field

from omniloop.errors import OmniloopError, RequestError
from omniloop.request import EventKind, OmniOutput, Status

from .engine import CostEstimator, closed_errors, make_engine, overload_errors
from .metrics import WorkerMetrics
from .protocol import (
    InvalidRequest,
    MappedRequest,
    api_field,
    image_response,
    map_image_request,
    map_video_request,
    video_data,
    video_response,
)

log = logging.getLogger("omniloop.dynamo")

HEALTH_CHECK_KEY = "_HEALTH_CHECK"
INSTALL_HINT = (
    "ai-dynamo is not importable in this Python ({python}). Install it with "
    "`bash plugins/frontends/dynamo/install-dynamo.sh` (ai-dynamo==1.6.1 and ai-dynamo-runtime==1.6.1 --no-deps plus "
    "their real dependencies; a plain `pip install ai-dynamo` fails where only PyPI is reachable), then run "
    "the worker with the Python it prints: PY -m omniloop_dynamo.worker --deploy FILE"
)


@define
class WorkerOptions:
    deploy: str
    namespace: str = "omniloop"
    component: str = "worker"
    endpoint: str = "generate"
    model_name: str | None = None
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    scheduler: str | None = None
    modality: str = "auto"  # auto | video | image | both
    media_dir: str | None = None
    media_url: str | None = None
    drain_timeout: float = 600.0
    grace_period: float = 1.0
    warmup: bool = True
    allow_local_files: bool = False
    manager_factory: str | None = None
    scheduler_options: dict[str, Any] = field(factory=dict)


def _import_dynamo() -> dict[str, Any]:
    try:
        from dynamo.llm import (
            ModelInput,
            ModelRuntimeConfig,
            ModelType,
            WorkerType,
            register_model,
            unregister_model,
        )
        from dynamo.llm import exceptions as dyn_errors
        from dynamo.runtime import DistributedRuntime
    except ImportError as exc:
        raise click.ClickException(INSTALL_HINT.format(python=sys.executable) + f" ({exc})") from None
    return {
        "DistributedRuntime": DistributedRuntime, "ModelInput": ModelInput, "ModelType": ModelType,
        "WorkerType": WorkerType, "ModelRuntimeConfig": ModelRuntimeConfig, "register_model": register_model,
        "unregister_model": unregister_model, "errors": dyn_errors,
    }


_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:@+=-]")


def request_id_for(context_id: Any) -> str:
    """The omniloop request id of a Dynamo request: ``dyn-`` + the context id reduced to safe
    characters (a client may choose the id, e.g. through ``x-request-id``), at most 64 characters;
    a fresh random id when there is none. It names the request in logs and responses only."""
    cid = _UNSAFE_ID_CHARS.sub("_", str(context_id))[:59] if context_id else ""
    return f"dyn-{cid or uuid.uuid4().hex}"


def media_path(media_dir: Path, suffix: str) -> Path:
    """A fresh file in ``media_dir`` for one response: named by the worker (a random hex id),
    never by anything the client sent, and checked to resolve inside ``media_dir``."""
    root = media_dir.resolve()
    path = (root / f"{uuid.uuid4().hex}{suffix}").resolve()
    if path.parent != root:
        raise RuntimeError(f"media path {path} is outside the media folder {root}")
    return path


def default_fps(rt: Any, tasks: set[str]) -> float | None:
    """The frame rate a video request gets when it sets none (``seconds`` -> frames uses it):
    ``Runtime.defaults(task)`` (the family's per-task defaults), else the checkpoint config's or
    the family's ``defaults``."""
    fps = None
    task = next((t for t in ("t2v", "i2v") if t in tasks), None)
    if task is not None and callable(getattr(rt, "defaults", None)):
        try:
            fps = rt.defaults(task).get("fps")
        except Exception:  # a family without per-task defaults
            fps = None
    if not fps:
        cfg = getattr(rt.model, "config", None) or {}
        defaults = cfg.get("defaults") if isinstance(cfg, dict) else None  # the family's task_defaults came first
        fps = defaults.get("fps") if isinstance(defaults, dict) else None
    return float(fps) if isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0 else None


def _load_object(spec: str) -> Any:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise click.BadParameter(f"expected MODULE:ATTRIBUTE, got {spec!r}", param_hint="--manager-factory")
    return getattr(importlib.import_module(mod), attr)


class OmniloopDynamoWorker:
    """The worker; :meth:`run` serves until SIGTERM/SIGINT (or :meth:`drain`) and returns."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.dyn = _import_dynamo()
        self.E = self.dyn["errors"]
        self.runtime: Any = None
        self.engine: Any = None
        self.cost: CostEstimator | None = None
        self.drt: Any = None
        self.endpoints: list[Any] = []
        self.metrics = WorkerMetrics(options.model_name or "")
        self.model_name = options.model_name or ""
        self._draining = False
        self._refusing = False
        self._drained = asyncio.Event()
        self._media_dir: Path | None = None
        self._tasks: set[str] = set()
        self._default_fps: float | None = None
        self._drain_task: asyncio.Future[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        o = self.options
        self.drt = self.dyn["DistributedRuntime"](loop, o.discovery_backend, o.request_plane)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        self.runtime = await asyncio.to_thread(self._load_runtime)
        self._setup_model_facts()
        self.engine = make_engine(self.runtime, o.scheduler, warmup=o.warmup, **o.scheduler_options)
        await self.engine.start()
        self.cost = CostEstimator(self.runtime, self.engine)
        if self._draining:  # a signal arrived while loading
            await self.engine.shutdown(drain=False, timeout=5.0)
            self.drt.shutdown()
            return
        serves = await self._register()
        try:
            self.drt.set_health_status(True)
        except Exception:  # older runtimes
            pass
        log.info("omniloop dynamo worker serving %r on %s", self.model_name,
                 ", ".join(f"{o.namespace}.{o.component}.{n}" for n, _ in serves))
        await asyncio.gather(*(coro for _, coro in serves))
        await self._drained.wait() if self._draining else None

    def _load_runtime(self) -> Any:
        from omniloop.deploy import check_in_process, load_deploy
        from omniloop.runtime import Runtime

        manager = _load_object(self.options.manager_factory)() if self.options.manager_factory else None
        deploy = load_deploy(self.options.deploy)
        check_in_process(deploy, "the omniloop Dynamo worker")  # before any weights load
        return Runtime.from_deploy(deploy, manager=manager)

    def _setup_model_facts(self) -> None:
        rt = self.runtime
        # what the checkpoint can do (a t2v checkpoint of a family that also does i2v: t2v only)
        tasks = rt.supported_tasks  # a plain Runtime here (check_in_process)
        self._tasks = {getattr(t, "value", str(t)) for t in tasks}
        self._default_fps = default_fps(rt, self._tasks)
        if not self.model_name:
            m = rt.deploy.model
            self.model_name = m.preset or Path(str(rt.model_path)).name
        self.metrics.model = self.model_name
        if self.options.media_dir:
            self._media_dir = Path(self.options.media_dir).expanduser().resolve()
        else:
            self._media_dir = Path(tempfile.gettempdir()) / "omniloop-dynamo-media"
        self._media_dir.mkdir(parents=True, exist_ok=True)

    def modalities(self) -> list[str]:
        video = bool(self._tasks & {"t2v", "i2v"})
        image = bool(self._tasks & {"t2i", "i2i"})
        m = self.options.modality
        if (m == "video" and not video) or (m == "image" and not image):
            raise click.ClickException(
                f"--modality {m}: model {self.model_name!r} does no {m} task (tasks: {', '.join(sorted(self._tasks))})"
            )
        if m in ("video", "image"):
            return [m]
        out = (["video"] if video else []) + (["image"] if image else [])
        if not out:
            raise click.ClickException(f"model {self.model_name!r} has no video or image task to serve")
        return out

    def runtime_data(self) -> dict[str, Any]:
        rt = self.runtime
        lim = rt.deploy.limits
        stats = {}
        try:
            stats = {k: v for k, v in self.engine.stats().items() if k in ("scheduler", "max_queue")}
        except Exception:
            pass
        return {
            "family": rt.family.name, "model": str(rt.model_path), "tasks": sorted(self._tasks),
            "device": str(rt.device), "dtype": rt.deploy.dtype,
            "limits": {"max_steps": lim.max_steps, "max_frames": lim.max_frames, "max_height": lim.max_height,
                       "max_width": lim.max_width, "max_queue": lim.max_queue},
            "engine": stats, "cost_model": self.cost.describe() if self.cost else {},
            "metrics": "omniloop_dynamo_outstanding_predicted_seconds (load, seconds), "
                       "omniloop_dynamo_request_predicted_seconds (per-request estimate)",
        }

    async def _register(self) -> list[tuple[str, Any]]:
        o, d = self.options, self.dyn
        serves: list[tuple[str, Any]] = []
        rc = d["ModelRuntimeConfig"]()
        try:
            rc.set_engine_specific("omniloop", json.dumps(self.runtime_data(), default=str))
        except Exception as exc:
            log.warning("could not publish runtime data in the model card: %s", exc)
        for i, kind in enumerate(self.modalities()):
            name = o.endpoint if kind == "video" else f"{o.endpoint}_images"
            ep = self.drt.endpoint(f"{o.namespace}.{o.component}.{name}")
            if i == 0:
                ep.metrics.register_prometheus_expfmt_callback(self._render_metrics)
            model_type = d["ModelType"].Videos if kind == "video" else d["ModelType"].Images
            await d["register_model"](
                d["ModelInput"].Text, model_type, ep, str(self.runtime.model_path), self.model_name,
                worker_type=d["WorkerType"].Aggregated, runtime_config=rc,
            )
            handler = self.generate_video if kind == "video" else self.generate_image
            payload = {"prompt": "health check", "model": self.model_name, "response_format": "b64_json",
                       HEALTH_CHECK_KEY: True}
            self.endpoints.append(ep)
            serves.append((name, ep.serve_endpoint(handler, graceful_shutdown=True, health_check_payload=payload)))
        return serves

    def _on_signal(self, sig: int) -> None:
        log.info("received %s: draining", signal.Signals(sig).name)
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Unregister, finish in-flight work, refuse new requests, deregister the model, stop."""
        if self._draining:
            return
        self._draining = True
        self.metrics.draining = True
        o = self.options
        try:
            try:
                self.drt.set_health_status(False)
            except Exception:
                pass
            for ep in self.endpoints:
                try:
                    await ep.unregister_endpoint_instance()
                except Exception as exc:
                    log.warning("unregistering the endpoint instance failed: %s", exc)
            if self.endpoints and o.grace_period > 0:
                await asyncio.sleep(o.grace_period)  # requests routed before the unregister still arrive
            self._refusing = True
            if self.engine is not None:
                await self.engine.shutdown(drain=True, timeout=o.drain_timeout)
            deadline = time.monotonic() + 30.0
            while self.metrics.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # responses being encoded / sent
            for ep in self.endpoints:
                try:
                    await self.dyn["unregister_model"](ep)
                except Exception as exc:
                    log.warning("unregistering the model failed: %s", exc)
            log.info("drained; shutting down")
        finally:
            self._drained.set()
            self.drt.shutdown()

    # -- metrics ------------------------------------------------------------------------------------
    def _render_metrics(self) -> str:
        try:
            stats = self.engine.stats() if self.engine is not None else None
        except Exception:
            stats = None
        return self.metrics.render(stats)

    # -- handlers -------------------------------------------------------------------------------------
    async def generate_video(self, request: dict[str, Any], context: Any = None):
        async for chunk in self._serve("video", request, context):
            yield chunk

    async def generate_image(self, request: dict[str, Any], context: Any = None):
        async for chunk in self._serve("image", request, context):
            yield chunk

    def _probe(self, kind: str) -> dict[str, Any]:
        eng = self.engine
        thread = getattr(eng, "_thread", None)
        if eng is None or getattr(eng, "worker_error", None) is not None or (thread is not None and not thread.is_alive()):
            raise self.E.EngineShutdown("the omniloop engine thread is not running")
        with self.metrics.lock:
            self.metrics.probes += 1
        if kind == "video":
            return video_response(response_id="health", model=self.model_name, data=[])
        return image_response(data=[], size=None)

    def _request_id(self, context: Any) -> str:
        cid = None
        try:
            cid = context.id() if context is not None else None
        except Exception:
            cid = None
        return request_id_for(cid)

    async def _serve(self, kind: str, request: dict[str, Any], context: Any):
        E = self.E
        if isinstance(request, dict) and request.get(HEALTH_CHECK_KEY) is True:
            yield self._probe(kind)
            return
        if self._refusing:
            self.metrics.reject(kind, "refused_draining")
            raise E.EngineShutdown("this worker is draining and takes no new requests")
        rid = self._request_id(context)
        try:
            if kind == "video":
                mapped = map_video_request(request, request_id=rid, allow_local_files=self.options.allow_local_files,
                                           default_fps=self._default_fps)
            else:
                mapped = map_image_request(request, request_id=rid, allow_local_files=self.options.allow_local_files)
        except InvalidRequest as exc:
            self.metrics.reject(kind, "invalid")
            raise E.InvalidArgument(str(exc)) from None
        handles = []
        try:
            for r in mapped.requests:
                handles.append(await self.engine.submit_async(r))  # prepared off the event loop
        except RequestError as exc:
            self._cancel(handles)
            self.metrics.reject(kind, "invalid")
            raise E.InvalidArgument(f"{api_field(exc.path)}: {exc.message}" if exc.path else exc.message) from None
        except closed_errors():
            self._cancel(handles)
            self.metrics.reject(kind, "refused_draining")
            raise E.EngineShutdown("this worker is draining and takes no new requests") from None
        except overload_errors() as exc:
            self._cancel(handles)
            self.metrics.reject(kind, "queue_full")
            raise E.WorkerUnavailable(str(exc)) from None
        predicted = self._predict(mapped)
        self.metrics.start(predicted)
        self._annotate(context, predicted, mapped)
        t0 = time.perf_counter()
        outcome, seconds = "failed", None
        try:
            if mapped.stream:
                async for chunk in self._progress(handles, mapped, rid, context):
                    yield chunk
            outputs = await self._wait(handles, context)
            failure = next((o for o in outputs if not o.ok), None)
            if failure is not None:
                outcome = failure.status.value
                raise self._error_for(failure)
            response = await asyncio.to_thread(self._encode, mapped, outputs, rid, time.perf_counter() - t0)
            seconds = time.perf_counter() - t0
            outcome = "completed"
            if self.cost is not None:
                for r, out in zip(mapped.requests, outputs, strict=True):
                    self.cost.observe(r, seconds, out)
            yield response
        except E.Cancelled:
            outcome = "cancelled"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            self._cancel(handles)
            raise
        except GeneratorExit:  # the client went away while streaming
            outcome = "cancelled"
            self._cancel(handles)
            raise
        finally:
            self.metrics.finish(kind, outcome, predicted, seconds)
            for h in handles:
                forget = getattr(self.engine, "forget", None)
                if forget is not None and h.done():
                    forget(h.request_id)

    def _predict(self, mapped: MappedRequest) -> float | None:
        if self.cost is None:
            return None
        total = 0.0
        for r in mapped.requests:
            p = self.cost.predict(r)
            if p is None:
                return None
            total += p
        return total

    @staticmethod
    def _annotate(context: Any, predicted: float | None, mapped: MappedRequest) -> None:
        """Put the cost estimate on the request's trace span (no-op without OTel)."""
        if context is None or predicted is None:
            return
        try:
            span = context.current_span()
            span.set_attribute("omniloop.predicted_seconds", float(predicted))
            span.set_attribute("omniloop.requests", len(mapped.requests))
        except Exception:
            pass

    def _cancel(self, handles: list[Any]) -> None:
        for h in handles:
            try:
                if not h.done():
                    self.engine.cancel(h.request_id)
            except Exception:
                pass

    async def _wait(self, handles: list[Any], context: Any) -> list[OmniOutput]:
        results = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
        stop = None
        if context is not None and hasattr(context, "async_killed_or_stopped"):
            try:
                stop = asyncio.ensure_future(context.async_killed_or_stopped())
            except Exception:
                stop = None
        try:
            if stop is None:
                return list(await results)
            done, _ = await asyncio.wait({results, stop}, return_when=asyncio.FIRST_COMPLETED)
            if results in done:
                return list(results.result())
            self._cancel(handles)  # the client disconnected or the request was stopped
            await asyncio.wait({results}, timeout=60.0)
            raise self.E.Cancelled("the request was cancelled")
        finally:
            if stop is not None and not stop.done():
                stop.cancel()

    async def _progress(self, handles: list[Any], mapped: MappedRequest, rid: str, context: Any):
        """Progress chunks for ``stream: true`` video requests (status ``in_progress``)."""
        last = -1
        async for ev in handles[0].events():
            if context is not None and getattr(context, "is_stopped", lambda: False)():
                self._cancel(handles)
                return
            if ev.kind is EventKind.PROGRESS and ev.total:
                pct = min(99, int(100 * (ev.step or 0) / ev.total))
                if pct != last:
                    last = pct
                    yield video_response(response_id=f"video_{rid}", model=mapped.model or self.model_name,
                                         data=[], status="in_progress", progress=pct)
            if ev.kind is EventKind.FINAL:
                return

    def _error_for(self, out: OmniOutput) -> BaseException:
        E = self.E
        err = out.error
        if out.status is Status.CANCELLED:
            return E.Cancelled("the request was cancelled")
        msg = f"{err.type}: {err.message}" if err else "generation failed"
        where = f" (node {err.node}, step {err.step})" if err and err.node else ""
        log.error("request %s failed%s: %s", out.request_id, where, msg)
        if err is not None and err.type in ("RequestError", "AdmissionRefused"):
            return E.InvalidArgument(err.message)
        return E.Unknown(f"generation failed{where}: {msg}")

    # -- media ------------------------------------------------------------------------------------------
    def _encode(self, mapped: MappedRequest, outputs: list[OmniOutput], rid: str, seconds: float) -> dict[str, Any]:
        from omniloop.artifacts import Audio, Image, VideoFrames
        from omniloop_io.media import write_mp4, write_png

        assert self._media_dir is not None
        data: list[dict[str, Any]] = []
        size = mapped.size
        for out in outputs:
            arts = list(out.artifacts.values())
            if mapped.kind == "video":
                vid = out.artifacts.get("video")
                vid = vid if isinstance(vid, VideoFrames) else next((a for a in arts if isinstance(a, VideoFrames)), None)
                if vid is None:
                    raise self.E.Unknown(f"the model produced no video (artifacts: {', '.join(out.artifacts)})")
                path = media_path(self._media_dir, ".mp4")
                sound = out.artifacts.get("audio")  # a video with a sound track (audio_tasks): its AAC track
                write_mp4(vid.frames, vid.fps, path,
                          audio=(sound.samples, int(sound.sample_rate)) if isinstance(sound, Audio) else None)
                data.append(self._deliver(path, mapped, fps=vid.fps, video=True))
            else:
                img = next((a for a in arts if isinstance(a, Image)), None)
                pixels = img.pixels if img is not None else None
                if pixels is None:
                    vid = next((a for a in arts if isinstance(a, VideoFrames)), None)
                    pixels = vid.frames[0] if vid is not None else None
                if pixels is None:
                    raise self.E.Unknown(f"the model produced no image (artifacts: {', '.join(out.artifacts)})")
                size = f"{pixels.shape[1]}x{pixels.shape[0]}"
                path = media_path(self._media_dir, ".png")
                write_png(pixels, path)
                data.append(self._deliver(path, mapped, video=False))
        if mapped.kind == "video":
            return video_response(response_id=f"video_{rid}", model=mapped.model or self.model_name, data=data,
                                  inference_time_s=seconds)
        return image_response(data=data, size=size)

    def _deliver(self, path: Path, mapped: MappedRequest, *, fps: float | None = None, video: bool) -> dict[str, Any]:
        if mapped.response_format == "b64_json":
            b64 = base64.b64encode(path.read_bytes()).decode("ascii")
            path.unlink(missing_ok=True)
            return video_data(b64_json=b64, fps=fps) if video else {"b64_json": b64}
        base = self.options.media_url
        url = f"{base.rstrip('/')}/{path.name}" if base else path.as_uri()
        return video_data(url=url, fps=fps) if video else {"url": url}


# --------------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------------


def _set_host(host: str | None) -> None:
    """Bind and advertise the request plane, response streams, events and system server on ``host``."""
    if not host:
        return
    for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        os.environ[var] = host


def serve(options: WorkerOptions) -> None:
    """Run a worker until it is drained (blocking)."""
    worker = OmniloopDynamoWorker(options)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(worker.run())


@click.command("dynamo-worker")
@click.option("--deploy", "deploy", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Deploy file (.yaml/.toml/.json) of the model this worker serves.")
@click.option("--namespace", default="omniloop", show_default=True, help="Dynamo namespace.")
@click.option("--component", default="worker", show_default=True, help="Dynamo component.")
@click.option("--endpoint", default="generate", show_default=True,
              help="Endpoint name for videos; images use ENDPOINT_images.")
@click.option("--model-name", default=None, help="Served model name (default: the preset or checkpoint folder name).")
@click.option("--discovery-backend", type=click.Choice(["etcd", "file", "kubernetes", "mem"]), default="etcd",
              envvar="DYN_DISCOVERY_BACKEND", show_default=True, show_envvar=True,
              help="Dynamo discovery backend; must match the frontend's. file uses DYN_FILE_KV as its folder.")
@click.option("--request-plane", type=click.Choice(["tcp", "nats"]), default="tcp", envvar="DYN_REQUEST_PLANE",
              show_default=True, show_envvar=True)
@click.option("--host", default=None, help="Address to bind and advertise (request plane, system server), e.g. 127.0.0.1.")
@click.option("--system-port", type=int, default=None, envvar="DYN_SYSTEM_PORT", show_envvar=True,
              help="Port of the system server (/health, /live, /metrics); off when unset.")
@click.option("--scheduler", type=click.Choice(["step", "serial"]), default=None,
              help="Engine scheduler (default: the deploy's when step/serial, else step).")
@click.option("--modality", type=click.Choice(["auto", "video", "image"]), default="auto", show_default=True,
              help="What to register: auto = every modality the model's tasks allow.")
@click.option("--media-dir", default=None, help="Where response_format=url media is written (default: a temp folder).")
@click.option("--media-url", default=None, help="Base URL under which --media-dir is served (default: file:// URLs).")
@click.option("--drain-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to finish in-flight requests after SIGTERM before cancelling them.")
@click.option("--grace-period", type=float, default=1.0, show_default=True,
              help="Seconds requests are still accepted after unregistering on SIGTERM.")
@click.option("--warmup/--no-warmup", default=True, show_default=True, help="Run one tiny request before registering.")
@click.option("--allow-local-files/--no-allow-local-files", default=False, show_default=True,
              help="Accept input_reference as a path / file:// URL on the worker's filesystem.")
@click.option("--manager-factory", default=None, hidden=True,
              help="MODULE:CALLABLE returning the omniloop PluginManager to use (tests).")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
def dynamo_worker_command(deploy: str, namespace: str, component: str, endpoint: str, model_name: str | None,
                          discovery_backend: str, request_plane: str, host: str | None, system_port: int | None,
                          scheduler: str | None, modality: str, media_dir: str | None, media_url: str | None,
                          drain_timeout: float, grace_period: float, warmup: bool, allow_local_files: bool,
                          manager_factory: str | None, verbose: bool) -> None:
    """Serve a deployment as an NVIDIA Dynamo worker (behind `python -m dynamo.frontend`)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _set_host(host)
    if system_port is not None:
        os.environ["DYN_SYSTEM_PORT"] = str(system_port)
    os.environ.setdefault("DYN_DISCOVERY_BACKEND", discovery_backend)
    os.environ.setdefault("DYN_REQUEST_PLANE", request_plane)
    opts = WorkerOptions(
        deploy=deploy, namespace=namespace, component=component, endpoint=endpoint, model_name=model_name,
        discovery_backend=discovery_backend, request_plane=request_plane, scheduler=scheduler, modality=modality,
        media_dir=media_dir, media_url=media_url, drain_timeout=drain_timeout, grace_period=grace_period,
        warmup=warmup, allow_local_files=allow_local_files, manager_factory=manager_factory,
    )
    try:
        serve(opts)
    except OmniloopError as exc:
        raise click.ClickException(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    dynamo_worker_command.main(args=argv, prog_name="python -m omniloop_dynamo.worker")


if __name__ == "__main__":
    main()
