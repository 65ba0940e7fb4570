"""``POST /v1/images/edits``: OpenAI's image edit → the family's ``i2i`` task (FLUX.1, SD3, ...).

Takes ``multipart/form-data`` as the ``openai`` SDK's ``images.edit`` sends it (``image`` — one
uploaded file, or ``image[]`` holding one —, ``prompt``, ``n``, ``size``, ``response_format``,
``extra_body`` keys as more form fields, nested ones bracketed) and the same fields as JSON (the
image as base64, a ``data:`` URL or ``{"image_url": "data:..."}``). Fields:

* ``image`` → an image input part; the family resizes it to the output size (as diffusers does).
* ``strength`` (``extra_body``; ``0 < strength <= 1``) → ``node_params.denoise.strength``: how much
  of the schedule runs; the family's default when unset (diffusers' pipeline default).
* ``prompt``, ``negative_prompt``, ``n`` (seeds ``seed + i``), ``size`` (``"WxH"`` or ``"auto"``:
  the family's default size), ``steps``, ``guidance_scale``, ``seed``, ``omniloop`` as for
  ``/v1/images/generations``; PNG out.
* ``mask`` (inpainting) and more than one input image are refused with a 422 naming the field.

The answer is the generations answer: ``{"created", "data": [{"b64_json"}], "output_format": "png"}``;
with ``response_format: "url"`` each item is ``{"url"}`` instead, a ``GET /v1/images/files/<name>.png``
of this server (both endpoints): the PNG is written to the output folder under a server-made name
(32 hex digits), the newest :data:`MAX_IMAGE_FILES` are kept.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from omniloop.errors import RequestError
from omniloop.request import TaskType

from .bodies import (
    MappedBody,
    _apply_omniloop_images,
    _base,
    _image_bytes,
    expand_n,
    show,
)
from .body_schema import ImageEdit, fields_of

#: the body fields of ``POST /v1/images/edits`` (its class, :class:`.body_schema.ImageEdit`, is the definition)
EDIT_FIELDS = fields_of(ImageEdit)
#: the node whose ``strength`` knob i2i families read (FLUX.1, SD3)
STRENGTH_NODE = "denoise"
#: ``response_format: "url"`` images kept on disk (oldest deleted first)
MAX_IMAGE_FILES = 1000
IMAGE_FILE = re.compile(r"^[0-9a-f]{32}\.png$")
#: how often a waiting image request checks that its client is still connected
DISCONNECT_POLL_S = 0.5


class ImageFiles:
    """PNG files served at ``/v1/images/files/<name>``: server-made names, inside one folder, bounded."""

    def __init__(self, folder: Path, keep: int = MAX_IMAGE_FILES) -> None:
        self.folder = Path(folder).resolve()
        self.keep = keep
        # after a restart: the files made before are served (newest ``keep``), the older deleted
        found = sorted((p for p in self.folder.iterdir() if IMAGE_FILE.match(p.name)), key=lambda p: p.stat().st_mtime) \
            if self.folder.is_dir() else []
        for old in found[: max(0, len(found) - keep)]:
            old.unlink(missing_ok=True)
        self.names: deque[str] = deque(p.name for p in found[max(0, len(found) - keep):])

    def add(self, data: bytes) -> str:
        name = f"{uuid.uuid4().hex}.png"
        path = (self.folder / name).resolve()
        if path.parent != self.folder:  # never expected: the name is ours
            raise OSError(f"{path} is not in {self.folder}")
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self.names.append(name)
        while len(self.names) > self.keep:
            (self.folder / self.names.popleft()).unlink(missing_ok=True)
        return name

    def path(self, name: str) -> Path | None:
        """The file of a name this server made and still keeps, else None (any other string)."""
        if not IMAGE_FILE.match(name) or name not in self.names:
            return None
        path = (self.folder / name).resolve()
        return path if path.parent == self.folder and path.is_file() else None


def _err(path: str, msg: str) -> RequestError:
    return RequestError(path, msg)


def _one_image(body: Mapping[str, Any]) -> bytes:
    if "image" not in body:
        raise _err("image", "missing required field (the image to edit)")
    value = body["image"]
    if isinstance(value, list):
        if len(value) != 1:
            raise _err("image", f"exactly one input image is supported, got {len(value)}")
        value = value[0]
    return _image_bytes("image", value)


def map_edit_body(body: Any, *, tasks: frozenset[TaskType], model: str = "this model") -> MappedBody:
    """``POST /v1/images/edits`` body → ``n`` i2i request dicts."""
    if isinstance(body, Mapping) and body.get("size") == "auto":
        body = {k: v for k, v in body.items() if k != "size"}
    d, origins, info, b = _base(body, ImageEdit, TaskType.I2I, "imgedit")
    if TaskType.I2I not in tasks:
        does = ", ".join(sorted(t.value for t in tasks)) or "nothing"
        raise _err("model", f"{model} does not edit images (no i2i task; it does: {does})")
    if b.mask is not None:
        raise _err("mask", "masks (inpainting) are not supported; the whole image is re-generated from strength")
    info["response_format"] = b.response_format or "b64_json"
    data = _one_image(body)
    d["inputs"] = [*d.get("inputs", []), {"type": "image", "data_b64": base64.b64encode(data).decode("ascii"), "role": "image"}]
    origins["inputs.0"] = "image"  # the prompt (a top-level convenience field) is appended after it
    if b.strength is not None:
        d["node_params"] = {STRENGTH_NODE: {"strength": b.strength}}
        origins[f"node_params.{STRENGTH_NODE}.strength"] = "strength"
    d.setdefault("diffusion", {}).setdefault("frames", 1)
    origins.setdefault("diffusion.frames", "omniloop.diffusion.frames")
    _apply_omniloop_images(body, d, origins)
    return expand_n(b.n, d, origins, info)


def _png(out: Any) -> bytes:
    from omniloop_io.media import to_pil

    art = out.artifacts.get("image")
    pixels = art.pixels if art is not None else out.artifacts["video"].frames[0]
    buf = io.BytesIO()
    to_pil(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_files(state: Any) -> ImageFiles:
    """The server's :class:`ImageFiles` (in its output folder), made on first use."""
    files = getattr(state, "image_files", None)
    if files is None:
        files = state.image_files = ImageFiles(state.jobs.output_dir)
    return files


async def wait_all(engine: Any, handles: list[Any], request: Request | None) -> list[Any]:
    """Every handle's output; a client that disconnects meanwhile cancels them all (disconnect =
    cancel: a synchronous request nobody waits for stops at its next step boundary)."""
    waiting = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return list(waiting.result())
        if request is not None and await request.is_disconnected():
            for h in handles:
                engine.cancel(h.request_id)
            return list(await waiting)


async def images_response(engine: Any, handles: list[Any], mapped: MappedBody, *, state: Any = None,
                          base_url: str = "", request: Request | None = None) -> Response:
    """Wait for every image, then OpenAI's ``ImagesResponse`` (PNG; base64, or URLs of this server).
    ``request``: its client disconnecting cancels the images."""
    from .app import error

    outs = await wait_all(engine, handles, request)
    for h in handles:
        engine.forget(h.request_id)
    bad = next((o for o in outs if not o.ok), None)
    if bad is not None:
        msg = bad.error.message if bad.error else bad.status.value
        if state is not None and state.draining:  # cut by the shutdown: retry elsewhere / later
            return error(503, f"image generation {bad.status.value}: the server is shutting down ({msg})",
                         type_="server_error", code="shutting_down")
        return error(500, f"image generation {bad.status.value}: {msg}", type_="server_error", code=bad.status.value)
    as_url = mapped.info.get("response_format") == "url" and state is not None

    def encode() -> list[dict[str, str]]:
        pngs = [_png(o) for o in outs]
        if as_url:
            files = image_files(state)
            return [{"url": f"{base_url}/v1/images/files/{files.add(p)}"} for p in pngs]
        return [{"b64_json": base64.b64encode(p).decode("ascii")} for p in pngs]

    try:
        data = await asyncio.to_thread(encode)
    except Exception as exc:
        return error(500, f"encoding the image failed: {exc}", type_="server_error")
    resp: dict[str, Any] = {"created": int(time.time()), "data": data, "output_format": "png"}
    if "size" in mapped.info:
        resp["size"] = mapped.info["size"]
    return JSONResponse(resp)


def image_edit_routes(api: Any) -> list[Any]:
    """``POST /v1/images/edits`` on the app's helpers (see :func:`omniloop_server.app.create_app`)."""
    from starlette.routing import Route

    state, engine = api.state, api.engine

    async def edit_images(request: Request) -> Response:
        mapped = None
        try:
            body = await api.read_request_body(request, form=True)
            if state.draining:
                return api.closed()
            mapped = await state.off_loop(lambda: map_edit_body(body, tasks=state.tasks, model=repr(state.model_id)))
            state.check_model(body)
            handles = await api.submit(mapped)
        except Exception as exc:
            return api.translate(exc, mapped)
        state.track(handles)
        return await images_response(engine, handles, mapped, state=state, base_url=base_url(request, state),
                                     request=request)

    async def image_file(request: Request) -> Response:
        from .app import error

        name = request.path_params["name"]
        path = image_files(state).path(name)
        if path is None:
            return error(404, f"no image file {show(name)}", type_="invalid_request_error", param="name",
                         code="not_found")
        return FileResponse(path, media_type="image/png")

    return [Route("/v1/images/edits", edit_images, methods=["POST"]),
            Route("/v1/images/files/{name}", image_file, methods=["GET"])]


def base_url(request: Request, state: Any = None) -> str:
    """This server's URL, without a trailing /: ``--public-url`` when given, else the address of
    the socket the request came in on (scheme, local address and port, root path) — never the
    client's ``Host`` header, which anyone can set to any site."""
    public = getattr(state, "public_url", None)
    if public:
        return str(public).rstrip("/")
    server = request.scope.get("server")
    scheme = "https" if request.scope.get("scheme") in ("https", "wss") else "http"
    root = str(request.scope.get("root_path", "")).rstrip("/")
    if not server:
        return root  # relative URLs (an in-process client)
    host, port = server[0], server[1]
    if host and ":" in str(host):
        host = f"[{host}]"
    default = (scheme == "http" and port == 80) or (scheme == "https" and port == 443)
    return f"{scheme}://{host}{'' if default or port is None else f':{port}'}{root}"
