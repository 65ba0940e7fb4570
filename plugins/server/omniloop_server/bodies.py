"""OpenAI-style request bodies → omniloop request dicts, with errors naming the *body's* field.

A body's OpenAI fields (``prompt``, ``size: "WxH"``, ``seconds``, ``n`` ...) are mapped onto an
:class:`~omniloop.request.OmniRequest` dict; an ``omniloop`` sub-object is passed through as
OmniRequest fields (``diffusion``, ``plugin_params``, ``node_params``, ``outputs``, ``exact``,
``priority`` ...). Every mapped request field remembers the body field it came from, so a
:class:`RequestError` raised anywhere later (schema, limits, family validation) is reported with
the path the client wrote: ``steps``, ``size``, ``omniloop.diffusion.shift``.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping
from typing import Any

from attrs import define, field

from omniloop.errors import RequestError
from omniloop.request import TaskType

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")

COMMON_FIELDS = {
    "prompt", "negative_prompt", "model", "size", "steps", "num_inference_steps", "guidance_scale",
    "seed", "priority", "omniloop", "user",
}
VIDEO_FIELDS = COMMON_FIELDS | {"seconds", "frames", "fps", "image", "input_reference"}
IMAGE_FIELDS = COMMON_FIELDS | {"n", "response_format", "quality", "style", "background", "output_format"}
#: accepted for OpenAI client compatibility, without effect
IGNORED = {"user", "quality", "style", "background"}
MAX_IMAGES = 10


@define
class MappedBody:
    """The request dict(s) built from a body, and where each request field came from."""

    requests: list[dict[str, Any]]
    origins: dict[str, str] = field(factory=dict)
    info: dict[str, Any] = field(factory=dict)

    def body_path(self, path: str) -> str:
        return body_path(self.origins, path)


def body_path(origins: Mapping[str, str], path: str) -> str:
    """Translate an OmniRequest field path to the body field it came from (longest prefix wins)."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in origins:
            rest = parts[cut:]
            base = origins[prefix]
            # a mapped leaf (size → diffusion.height) keeps the body's name only
            return base if not rest or not base.startswith("omniloop") else ".".join([base, *rest])
    return f"omniloop.{path}" if path and origins.get("*") == "omniloop" else (path or "body")


def _err(path: str, msg: str) -> RequestError:
    return RequestError(path, msg)


def _num(body: Mapping[str, Any], name: str, *, integer: bool = False, allow_str: bool = False) -> Any:
    v = body[name]
    if allow_str and isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise _err(name, f"expected a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _err(name, f"expected {'an integer' if integer else 'a number'}, got {type(v).__name__} {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise _err(name, "expected a finite number")
    return v


def _size(body: Mapping[str, Any]) -> tuple[int, int]:
    v = body["size"]
    m = _SIZE.match(v) if isinstance(v, str) else None
    if not m:
        raise _err("size", f"expected \"WIDTHxHEIGHT\" (e.g. \"832x480\"), got {v!r}")
    w, h = int(m.group(1)), int(m.group(2))
    if w < 1 or h < 1:
        raise _err("size", "width and height must be positive")
    return w, h


def _merge(into: dict[str, Any], extra: Mapping[str, Any], origins: dict[str, str], prefix: str = "") -> None:
    """Deep-merge the ``omniloop`` object into the mapped dict; a field set by both is an error."""
    for k, v in extra.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if k in into and isinstance(into[k], dict) and isinstance(v, Mapping):
            _merge(into[k], v, origins, path)
            continue
        if k in into:
            raise _err(f"omniloop.{path}", f"given twice: also set by the body field {origins.get(path, path)!r}")
        into[k] = dict(v) if isinstance(v, Mapping) else v
        origins[path] = f"omniloop.{path}"


def _base(body: Any, allowed: set[str], task: TaskType, id_prefix: str) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    if not isinstance(body, Mapping):
        raise _err("body", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise _err(str(unknown[0]), f"unknown field (accepted: {', '.join(sorted(allowed))})")
    if "prompt" not in body:
        raise _err("prompt", "missing required field")
    d: dict[str, Any] = {"task": task.value, "request_id": f"{id_prefix}_{uuid.uuid4().hex[:20]}"}
    origins: dict[str, str] = {"inputs": "prompt", "task": "model"}
    diff: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for name in ("prompt", "negative_prompt"):
        if name in body:
            d[name] = body[name]
            origins[name] = name
    if "model" in body and not isinstance(body["model"], str):
        raise _err("model", f"expected a string, got {type(body['model']).__name__}")
    if "size" in body:
        w, h = _size(body)
        diff["width"], diff["height"] = w, h
        origins["diffusion.width"] = origins["diffusion.height"] = "size"
        info["size"] = f"{w}x{h}"
    for name in ("steps", "num_inference_steps"):
        if name in body:
            if "steps" in diff:
                raise _err(name, "given twice (steps and num_inference_steps)")
            diff["steps"] = body[name]
            origins["diffusion.steps"] = name
    for name, key in (("guidance_scale", "guidance_scale"), ("seed", "seed")):
        if name in body:
            diff[key] = body[name]
            origins[f"diffusion.{key}"] = name
    if "priority" in body:
        d["priority"] = body["priority"]
        origins["priority"] = "priority"
    if diff:
        d["diffusion"] = diff
    return d, origins, info


def _apply_omniloop(body: Mapping[str, Any], d: dict[str, Any], origins: dict[str, str]) -> None:
    extra = body.get("omniloop")
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise _err("omniloop", f"expected an object of OmniRequest fields, got {type(extra).__name__}")
    if "task" in extra:
        raise _err("omniloop.task", "the endpoint decides the task")
    if "request_id" in extra:
        d.pop("request_id", None)  # the client names its job
    _merge(d, extra, origins)


def map_video_body(body: Any, *, tasks: frozenset[TaskType], defaults: Mapping[str, Any], temporal_scale: int | None) -> MappedBody:
    """``POST /v1/videos`` body → one request dict (t2v, or i2v with an ``image``)."""
    has_image = isinstance(body, Mapping) and ("image" in body or "input_reference" in body)
    task = TaskType.I2V if has_image else TaskType.T2V
    d, origins, info = _base(body, VIDEO_FIELDS, task, "video")
    if task not in tasks:
        raise _err("image" if has_image else "model", f"this model does not do {task.value} (it does: {', '.join(sorted(t.value for t in tasks))})")
    diff = d.setdefault("diffusion", {})
    if "fps" in body:
        diff["fps"] = _num(body, "fps")
        origins["diffusion.fps"] = "fps"
    if "seconds" in body and "frames" in body:
        raise _err("frames", "give seconds or frames, not both")
    if "frames" in body:
        diff["frames"] = body["frames"]
        origins["diffusion.frames"] = "frames"
    elif "seconds" in body:
        seconds = _num(body, "seconds", allow_str=True)
        if seconds <= 0:
            raise _err("seconds", f"must be > 0, got {seconds}")
        fps = float(diff.get("fps") or (body.get("omniloop") or {}).get("diffusion", {}).get("fps") or defaults.get("fps", 16.0))
        frames = max(1, round(seconds * fps))
        if temporal_scale and temporal_scale > 1:  # e.g. Wan: 4k+1 frames
            frames = max(1, round((frames - 1) / temporal_scale)) * temporal_scale + 1
        diff["frames"] = frames
        origins["diffusion.frames"] = "seconds"
        info["seconds"] = seconds
    if has_image:
        name = "image" if "image" in body else "input_reference"
        data = body[name]
        if not isinstance(data, str) or not data:
            raise _err(name, "expected base64 image data (or a data: URL)")
        if data.startswith("data:"):
            data = data.split(",", 1)[-1]
        d["inputs"] = [{"type": "image", "data_b64": data, "role": "first_frame"}]
        origins["inputs"] = name
    if not diff:
        d.pop("diffusion")
    _apply_omniloop(body, d, origins)
    return MappedBody([d], origins, info)


def map_image_body(body: Any, *, tasks: frozenset[TaskType]) -> MappedBody:
    """``POST /v1/images/generations`` body → ``n`` t2i request dicts (seeds ``seed + i``)."""
    d, origins, info = _base(body, IMAGE_FIELDS, TaskType.T2I, "img")
    if TaskType.T2I not in tasks:
        raise _err("model", "this model does not generate images (no t2i task)")
    n = 1
    if "n" in body:
        n = _num(body, "n", integer=True)
        if not 1 <= n <= MAX_IMAGES:
            raise _err("n", f"must be between 1 and {MAX_IMAGES}, got {n}")
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise _err("response_format", f"only \"b64_json\" is supported, got {fmt!r}")
    ofmt = body.get("output_format", "png")
    if ofmt != "png":
        raise _err("output_format", f"only \"png\" is supported, got {ofmt!r}")
    d.setdefault("diffusion", {}).setdefault("frames", 1)
    origins.setdefault("diffusion.frames", "omniloop.diffusion.frames")
    _apply_omniloop_images(body, d, origins)
    reqs = []
    base_id = d["request_id"]
    seed = d["diffusion"].get("seed")
    for i in range(n):
        r = {**d, "diffusion": dict(d["diffusion"]), "request_id": f"{base_id}_{i}" if n > 1 else base_id}
        if seed is not None and isinstance(seed, int) and not isinstance(seed, bool):
            r["diffusion"]["seed"] = seed + i
        reqs.append(r)
    info["n"] = n
    return MappedBody(reqs, origins, info)


def _apply_omniloop_images(body: Mapping[str, Any], d: dict[str, Any], origins: dict[str, str]) -> None:
    extra = body.get("omniloop")
    if isinstance(extra, Mapping) and isinstance(extra.get("diffusion"), Mapping) and "frames" in extra["diffusion"]:
        d["diffusion"].pop("frames", None)  # an explicit frames wins over the image default
    _apply_omniloop(body, d, origins)
