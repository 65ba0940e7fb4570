"""ComfyUI's server API on ``omniloop serve`` (mounted through ``omniloop.server_routes``).

=================================  ===============================================================
``POST /prompt``                   ``{prompt, client_id, extra_data, front,
                                   partial_execution_targets}`` → ``{prompt_id, number,
                                   node_errors}``; a graph that does not compile → 400
                                   ``{error, node_errors}`` (ComfyUI's shapes, :mod:`.errors`)
``GET /history[/{prompt_id}]``     ``{id: {prompt, outputs: {node: {images: [{filename,
                                   subfolder, type}]}}, status}}`` (``?max_items=N``)
``GET /view``                      ``?filename=&subfolder=&type=output|temp|input``: files of this
                                   server's ComfyUI folders only (plain names, resolved inside)
``GET /object_info[/{class}]``     the supported node classes, ComfyUI's schema (:mod:`.nodes`)
``GET /queue``                     ``{queue_running, queue_pending}``; ``GET /prompt``: queue size
``POST /interrupt``                cancel the running prompt (at its next step)
``GET /system_stats``              version and device, as ComfyUI clients read it
``POST /upload/image``             an input image (multipart ``image``), stored under a server-made
                                   name → ``{name, subfolder, type}`` for ``LoadImage``
``WS /ws?clientId=``               ``status``, ``execution_start``, ``executing`` (``node: null``
                                   when done), ``progress``, ``executed``, ``execution_success``,
                                   ``execution_error``, ``execution_interrupted``
=================================  ===============================================================

Each compiled request is validated at ``POST /prompt`` (the schema, then ``Runtime.prepare``: a
size the model cannot do is a 400 node error, not a later ``execution_error``). Prompts run one at
a time in queue order (as in ComfyUI); each compiled job is one engine request,
so the runtime's scheduler batches it with the server's other requests. Files go under
``<output dir>/comfyui/{output,temp}``; ``LoadImage`` reads ``<output dir>/comfyui/input``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from .compiler import CompiledPrompt, Target, compile_workflow
from .errors import WorkflowError, node_error, show
from .nodes import object_info

log = logging.getLogger("omniloop.comfyui")

MAX_HISTORY = 1000
MAX_UPLOAD = 32 * 1024 * 1024
MAX_PENDING = 256
#: /view: one plain file name; a subfolder of plain names
VIEW_NAME = re.compile(r"^(?!\.)[A-Za-z0-9_\-. ]{1,200}$")
VIEW_SUB = re.compile(r"^((?!\.)[A-Za-z0-9_\-. %:]{1,100})(/(?!\.)[A-Za-z0-9_\-. %:]{1,100}){0,4}$")
CLIENT_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")


def _bad(body: dict[str, Any], status: int = 400) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _invalid(message: str, status: int = 400) -> JSONResponse:
    return _bad({"error": {"type": "invalid_prompt", "message": message, "details": "", "extra_info": {}},
                 "node_errors": {}}, status)


class _Prompt:
    def __init__(self, number: int, pid: str, prompt: dict[str, Any], extra: dict[str, Any], client: str | None,
                 compiled: CompiledPrompt) -> None:
        self.number, self.id, self.prompt, self.extra, self.client = number, pid, prompt, extra, client
        self.compiled = compiled
        self.outputs = [s.node_id for j in compiled.jobs for s in j.saves]
        self.handles: list[Any] = []
        self.interrupted = False

    def row(self) -> list[Any]:
        return [self.number, self.id, self.prompt, self.extra, self.outputs]


class ComfyState:
    def __init__(self, api: Any) -> None:
        self.api = api
        self.state = api.state
        self.engine = api.engine
        root = Path(self.state.jobs.output_dir) / "comfyui"
        self.folders = {"output": root / "output", "temp": root / "temp", "input": root / "input"}
        for f in self.folders.values():
            f.mkdir(parents=True, exist_ok=True)
        self.target = Target.from_runtime(self.state.runtime, model=self.state.model_id, input_dir=self.folders["input"])
        self.pending: list[_Prompt] = []
        self.running: _Prompt | None = None
        self.history: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.sockets: dict[str, set[WebSocket]] = {}
        self.number = 0
        self.wake: asyncio.Event | None = None
        self.worker: asyncio.Task[None] | None = None

    # -- messages -----------------------------------------------------------------------------
    async def send(self, type_: str, data: dict[str, Any], client: str | None) -> None:
        """To the prompt's client (ComfyUI's rule), or to every socket when ``client`` is None."""
        targets = [ws for c, s in self.sockets.items() if client is None or c == client for ws in s]
        text = json.dumps({"type": type_, "data": data})
        for ws in targets:
            try:
                await ws.send_text(text)
            except Exception:  # a socket closing under us: its handler removes it
                pass

    def status(self) -> dict[str, Any]:
        return {"status": {"exec_info": {"queue_remaining": len(self.pending) + (self.running is not None)}}}

    # -- the queue ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.worker is None or self.worker.done():
            self.wake = asyncio.Event()
            self.worker = asyncio.get_running_loop().create_task(self._work(), name="omniloop-comfyui")

    async def _work(self) -> None:
        assert self.wake is not None
        while True:
            while not self.pending:
                self.wake.clear()
                await self.wake.wait()
            p = self.pending.pop(0)
            self.running = p
            try:
                await self._execute(p)
            except Exception as exc:  # never let the worker die
                log.exception("comfyui prompt %s failed", p.id)
                self._record(p, "error", {}, [("execution_error", {"exception_message": str(exc)})])
            finally:
                self.running = None
                await self.send("status", self.status(), None)

    async def _execute(self, p: _Prompt) -> None:
        t0 = int(time.time() * 1000)
        messages: list[tuple[str, dict[str, Any]]] = [("execution_start", {"prompt_id": p.id, "timestamp": t0})]
        await self.send("execution_start", {"prompt_id": p.id, "timestamp": t0}, p.client)
        outputs: dict[str, Any] = {}
        results: dict[str, Any] = {}  # job key -> its output (a later job may take its image)
        for job in p.compiled.jobs:
            if p.interrupted:
                break
            samplers = [n for n in job.nodes if n not in {sp.node_id for sp in job.saves}]
            await self.send("executing", {"node": samplers[0] if samplers else job.key,
                                          "display_node": samplers[0] if samplers else job.key, "prompt_id": p.id}, p.client)
            try:
                handle = await self.engine.submit_async(await asyncio.to_thread(job.ready, results))
            except Exception as exc:
                await self._error(p, job.key, exc, messages, outputs)
                return
            p.handles.append(handle)
            self.state.track([handle])
            current = samplers[0] if samplers else job.key
            async for ev in handle.events():
                if getattr(ev, "total", None) and ev.step is not None and str(ev.kind) == "progress":
                    # a two-expert job: the second sampler node from the router's switch on
                    node = samplers[1] if job.split is not None and ev.step > job.split else samplers[0]
                    if node != current:
                        current = node
                        await self.send("executing", {"node": node, "display_node": node, "prompt_id": p.id}, p.client)
                    await self.send("progress", {"value": int(ev.step), "max": int(ev.total), "prompt_id": p.id,
                                                 "node": node}, p.client)
            out = await handle.result()
            self.engine.forget(handle.request_id)
            if not out.ok:
                if out.status.value == "cancelled" or p.interrupted:
                    p.interrupted = True
                    break
                await self._error(p, job.key, RuntimeError(out.error.message if out.error else "failed"), messages,
                                  outputs, type_=out.error.type if out.error else "RuntimeError")
                return
            results[job.key] = out
            for node in samplers[1:]:  # the rest of the chain before the saves (VAEDecode)
                if node != current and not (job.split is not None and node == samplers[1]):
                    await self.send("executing", {"node": node, "display_node": node, "prompt_id": p.id}, p.client)
            for spec in job.saves:
                await self.send("executing", {"node": spec.node_id, "display_node": spec.node_id, "prompt_id": p.id},
                                p.client)
            folder = self.folders["output"]
            try:
                written = await asyncio.to_thread(_write, job, out, folder, self.folders["temp"], p)
            except Exception as exc:
                await self._error(p, job.saves[0].node_id, exc, messages, outputs)
                return
            for node_id, ui in written.items():
                outputs[node_id] = ui
                data = {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": p.id}
                messages.append(("executed", data))
                await self.send("executed", data, p.client)
        if p.interrupted:
            data = {"prompt_id": p.id, "node_id": None, "node_type": None, "executed": list(outputs)}
            messages.append(("execution_interrupted", data))
            await self.send("execution_interrupted", data, p.client)
            self._record(p, "error", outputs, messages)
            return
        done = {"prompt_id": p.id, "timestamp": int(time.time() * 1000)}
        messages.append(("execution_success", done))
        await self.send("executing", {"node": None, "prompt_id": p.id}, p.client)
        await self.send("execution_success", done, p.client)
        self._record(p, "success", outputs, messages)

    async def _error(self, p: _Prompt, node: str, exc: Exception, messages: list[Any], outputs: dict[str, Any],
                     type_: str | None = None) -> None:
        ct = p.prompt.get(node, {}).get("class_type")
        data = {"prompt_id": p.id, "node_id": node, "node_type": ct, "executed": list(outputs),
                "exception_message": str(getattr(exc, "message", None) or exc)[:1000],
                "exception_type": type_ or type(exc).__name__, "traceback": [], "current_inputs": {},
                "current_outputs": {}}
        messages.append(("execution_error", data))
        await self.send("execution_error", data, p.client)
        self._record(p, "error", outputs, messages)

    def _record(self, p: _Prompt, status: str, outputs: dict[str, Any], messages: list[Any]) -> None:
        self.history[p.id] = {"prompt": p.row(), "outputs": outputs,
                              "status": {"status_str": status, "completed": status == "success",
                                         "messages": [[k, v] for k, v in messages]}, "meta": {}}
        while len(self.history) > MAX_HISTORY:
            self.history.popitem(last=False)


def _write(job: Any, out: Any, folder: Path, temp: Path, p: _Prompt) -> dict[str, Any]:
    from .save import write_job_outputs

    extra = p.extra.get("extra_pnginfo") if isinstance(p.extra.get("extra_pnginfo"), dict) else None
    regular = [s for s in job.saves if not s.temp]
    previews = [s for s in job.saves if s.temp]
    result: dict[str, Any] = {}
    if regular:
        job_r = type(job)(key=job.key, request=job.request, saves=regular)
        result.update(write_job_outputs(job_r, out, folder, prompt=p.prompt, extra_pnginfo=extra))
    if previews:
        job_p = type(job)(key=job.key, request=job.request, saves=previews)
        result.update(write_job_outputs(job_p, out, temp))
    return result


def comfyui_routes(api: Any) -> list[BaseRoute]:
    """The routes (the server's ``omniloop.server_routes`` entry point ``comfyui``)."""
    from omniloop.errors import DeployError

    try:  # the deploy's comfyui section, checked when the app is built (before serving)
        state = ComfyState(api)
    except ValueError as exc:
        raise DeployError(str(exc)) from None

    def comfy() -> ComfyState:
        state.start()  # the queue worker, on the server's event loop
        return state

    async def post_prompt(request: Request) -> Response:
        c = comfy()
        from omniloop.errors import RequestError
        from omniloop_server.bodies import BodyTooLarge

        try:  # read up to the limit (never past it), parsed off the event loop (a large body in a helper process)
            body = await c.api.read_json(request, 32 * 1024 * 1024, check=False)
        except BodyTooLarge:
            return _invalid("body larger than 32 MiB", 413)
        except RequestError as exc:
            return _invalid(f"the body is not JSON: {show(exc.message, 200)}")
        if not isinstance(body, dict) or "prompt" not in body:
            return _invalid("expected {\"prompt\": {...}, \"client_id\": ..., \"extra_data\": {...}}")
        if c.state.draining:
            return _invalid("the server is shutting down", 503)
        client = body.get("client_id")
        if client is not None and (not isinstance(client, str) or not CLIENT_ID.match(client)):
            return _invalid(f"client_id: 1-128 letters, digits or _ - . :, got {show(client)}")
        extra = body.get("extra_data") or {}
        if not isinstance(extra, dict):
            return _invalid("extra_data must be an object")
        prompt = body["prompt"]
        if not isinstance(prompt, dict):
            return _invalid("prompt must be an object of nodes {id: {class_type, inputs}}")
        targets = body.get("partial_execution_targets")
        if targets is not None and (not isinstance(targets, list) or len(targets) > 1000
                                    or not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in targets)):
            return _invalid("partial_execution_targets must be a list of output node ids")
        front = body.get("front", False)
        if not isinstance(front, bool):
            return _invalid("front must be true or false")
        try:
            compiled = await asyncio.to_thread(
                lambda: compile_workflow(prompt, c.target, outputs=[str(t) for t in targets] if targets else None))
            _check_requests(compiled, c.state.runtime)
        except WorkflowError as exc:
            return _bad(exc.body())
        except RecursionError:
            return _invalid("the prompt is nested too deeply")
        if len(c.pending) >= MAX_PENDING:
            return _invalid(f"the queue is full ({MAX_PENDING} prompts)", 429)
        pid = str(uuid.uuid4())
        c.number += 1
        p = _Prompt(c.number, pid, compiled.prompt, extra, client, compiled)
        if front:  # ComfyUI's "front": ahead of the other pending prompts
            c.pending.insert(0, p)
        else:
            c.pending.append(p)
        assert c.wake is not None
        c.wake.set()
        await c.send("status", c.status(), None)
        return JSONResponse({"prompt_id": pid, "number": p.number, "node_errors": {}})

    async def get_prompt(request: Request) -> Response:
        return JSONResponse({"exec_info": comfy().status()["status"]["exec_info"]})

    async def history(request: Request) -> Response:
        c = comfy()
        items = list(c.history.items())
        m = request.query_params.get("max_items")
        if m is not None:
            if not m.isdigit():
                return _invalid("max_items must be a non-negative integer")
            items = items[-int(m):] if int(m) else []
        return JSONResponse(dict(items))

    async def history_one(request: Request) -> Response:
        c = comfy()
        pid = request.path_params["prompt_id"]
        return JSONResponse({pid: c.history[pid]} if pid in c.history else {})

    async def view(request: Request) -> Response:
        c = comfy()
        q = request.query_params
        name, sub, kind = q.get("filename", ""), q.get("subfolder", ""), q.get("type", "output")
        if kind not in c.folders:
            return _invalid("type must be output, temp or input")
        if not VIEW_NAME.match(name) or (sub and (not VIEW_SUB.match(sub) or ".." in sub.split("/"))):
            return _invalid("filename / subfolder: plain names inside the server's folder only")
        root = c.folders[kind].resolve()
        path = (root / sub / name).resolve() if sub else (root / name).resolve()
        if root not in path.parents or not path.is_file():
            return Response(status_code=404)
        media = {".png": "image/png", ".webp": "image/webp", ".webm": "video/webm", ".mp4": "video/mp4"}.get(
            path.suffix.lower(), "application/octet-stream")
        return FileResponse(path, media_type=media, filename=name)

    async def info(request: Request) -> Response:
        c = comfy()
        only = request.path_params.get("node_class")
        return JSONResponse(object_info(c.target.names(), only))

    async def queue(request: Request) -> Response:
        c = comfy()
        return JSONResponse({"queue_running": [c.running.row()] if c.running else [],
                             "queue_pending": [p.row() for p in c.pending]})

    async def interrupt(request: Request) -> Response:
        c = comfy()
        p = c.running
        if p is not None:
            p.interrupted = True
            for h in p.handles:
                c.engine.cancel(h.request_id)
        return Response(status_code=200)

    async def upload_image(request: Request) -> Response:
        """``multipart/form-data`` ``image`` (+ ``subfolder``, ``type`` input|temp, ``overwrite``
        ignored): stored under a server-made name (``<32 hex>.<format>``; the client's file name is
        never a path here) → ``{name, subfolder, type}``, the value ``LoadImage`` takes."""
        c = comfy()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_UPLOAD:
            return _invalid(f"upload larger than {MAX_UPLOAD} bytes", 413)
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_UPLOAD)
        except Exception as exc:  # python-multipart's and Starlette's errors alike
            return _invalid(f"malformed multipart/form-data body: {show(str(exc), 120)}")
        try:
            image = form.get("image")
            sub = form.get("subfolder") or ""
            kind = form.get("type") or "input"
            if image is None or isinstance(image, str):
                return _invalid("image: expected an uploaded file")
            if not isinstance(sub, str) or not isinstance(kind, str) or kind not in ("input", "temp"):
                return _invalid("type must be input or temp")
            if sub and (not VIEW_SUB.match(sub) or ".." in sub.split("/")):
                return _invalid("subfolder: plain names inside the server's folder only")
            data = await image.read(MAX_UPLOAD + 1)
        finally:
            await form.close()
        if len(data) > MAX_UPLOAD:
            return _invalid(f"upload larger than {MAX_UPLOAD} bytes", 413)
        try:
            ext = await asyncio.to_thread(_image_format, data)
        except Exception as exc:
            return _invalid(f"image: not an image this server reads ({type(exc).__name__})")
        root = c.folders[kind].resolve()
        folder = (root / sub).resolve() if sub else root
        if folder != root and root not in folder.parents:
            return _invalid("subfolder: plain names inside the server's folder only")
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{uuid.uuid4().hex}.{ext}"
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(folder / name)
        return JSONResponse({"name": name, "subfolder": sub, "type": kind})

    async def system_stats(request: Request) -> Response:
        import torch

        rt = comfy().state.runtime
        return JSONResponse({"system": {"os": "omniloop", "comfyui_version": "omniloop-comfyui 0.1.0",
                                        "python_version": "", "pytorch_version": torch.__version__,
                                        "embedded_python": False},
                             "devices": [{"name": str(rt.device), "type": str(rt.device).split(":")[0], "index": 0}]})

    async def ws(websocket: WebSocket) -> None:
        c = comfy()
        client = websocket.query_params.get("clientId") or uuid.uuid4().hex
        if not CLIENT_ID.match(client):
            await websocket.close(code=1008)
            return
        await websocket.accept()
        c.sockets.setdefault(client, set()).add(websocket)
        try:
            await websocket.send_text(json.dumps({"type": "status", "data": {**c.status(), "sid": client}}))
            while True:  # ComfyUI clients send nothing; read until they go
                await websocket.receive_text()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            s = c.sockets.get(client)
            if s is not None:
                s.discard(websocket)
                if not s:
                    c.sockets.pop(client, None)

    return [
        Route("/prompt", post_prompt, methods=["POST"]),
        Route("/prompt", get_prompt, methods=["GET"]),
        Route("/history", history, methods=["GET"]),
        Route("/history/{prompt_id}", history_one, methods=["GET"]),
        Route("/view", view, methods=["GET"]),
        Route("/object_info", info, methods=["GET"]),
        Route("/object_info/{node_class}", info, methods=["GET"]),
        Route("/queue", queue, methods=["GET"]),
        Route("/interrupt", interrupt, methods=["POST"]),
        Route("/system_stats", system_stats, methods=["GET"]),
        Route("/upload/image", upload_image, methods=["POST"]),
        WebSocketRoute("/ws", ws),
    ]


def _image_format(data: bytes) -> str:
    """The file extension of an image Pillow decodes (png, jpg, webp); anything else raises."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        fmt = (im.format or "").lower()
        im.load()
    ext = {"png": "png", "jpeg": "jpg", "webp": "webp"}.get(fmt)
    if ext is None:
        raise ValueError(f"format {fmt!r} (png, jpeg or webp)")
    return ext


def _check_requests(compiled: CompiledPrompt, runtime: Any = None) -> None:
    """Each compiled request validated before the prompt is queued, as ComfyUI validates inputs at
    ``/prompt``: the request schema, then — with ``runtime`` — the runtime's own checks
    (``Runtime.prepare``: sizes, limits, tasks, adapters; what ``engine.submit`` runs, in the same
    thread). A request fed by another job's image is checked against the schema only (its image
    exists once that job ran). A problem is a node error on the job's sampler node, naming the field."""
    from omniloop.errors import RequestError
    from omniloop.schema import as_request

    errors: dict[str, Any] = {}
    for job in compiled.jobs:
        try:
            req = as_request(job.request)
            if runtime is not None and not job.inputs_from:
                runtime.prepare(req)
        except RequestError as exc:
            entry = node_error("invalid_request", f"{exc.path}: {exc.message}", field=exc.path)
        except Exception as exc:  # validation raised something else: still the request's fault
            entry = node_error("invalid_request", f"{type(exc).__name__}: {show(str(exc), 300)}")
        else:
            continue
        errors[job.key] = {"errors": [entry], "class_type": compiled.prompt.get(job.key, {}).get("class_type"),
                           "dependent_outputs": [sp.node_id for sp in job.saves]}
    if errors:
        raise WorkflowError.from_nodes(errors)
