"""Dynamo's media requests and responses, mapped onto omniloop requests and outputs.

Pure Python (no ``dynamo`` import), so it is testable without ai-dynamo installed. The shapes
follow ``dynamo.common.protocols.video_protocol`` / ``image_protocol`` of ai-dynamo 1.6.1:

* ``NvCreateVideoRequest``: ``prompt``, ``model``, ``input_reference`` (I2V), ``seconds``,
  ``size`` ("WxH"), ``user``, ``response_format`` ("url" | "b64_json"), ``output_format``,
  ``stream``, ``nvext`` {``fps``, ``num_frames``, ``negative_prompt``, ``num_inference_steps``,
  ``guidance_scale``, ``seed``, ``boundary_ratio``, ``guidance_scale_2``, ``annotations``},
  ``extra_args`` {``media_passthrough``: the unknown top-level fields of the HTTP body}.
* ``NvVideosResponse``: ``id``, ``object``, ``model``, ``status``, ``progress``, ``created``,
  ``data`` [``VideoData`` {``output_format`` (required), ``url`` | ``b64_json``, ``fps``}],
  ``error``, ``inference_time_s``.
* ``NvCreateImageRequest``: ``prompt``, ``model``, ``n``, ``quality``, ``response_format``, ``size``,
  ``style``, ``user``, ``moderation``, ``input_reference`` (I2I), ``nvext`` {``negative_prompt``,
  ``num_inference_steps``, ``guidance_scale``, ``seed``}; ``NvImagesResponse``: ``created``,
  ``data`` [{``url`` | ``b64_json``}], ``output_format``, ``size``.

Every problem with a request raises :class:`InvalidRequest` naming the API field
(``nvext.num_inference_steps``, ``size``); the worker turns it into Dynamo's ``InvalidArgument``
(HTTP 400 with the message).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from attrs import define, field

from omniloop.errors import MAX_MESSAGE_CHARS, MAX_PATH_CHARS, RequestError, cap_text
from omniloop.request import MAX_FPS, OmniRequest
from omniloop.schema import brief, request_from_dict

#: the key Dynamo's frontend nests unknown top-level request fields under (``extra_args``)
MEDIA_PASSTHROUGH_KEY = "media_passthrough"

#: ``omniloop serve``'s extra fields, accepted here too so one OpenAI-SDK call works against both
#: (``extra_body={"steps": 4, "seed": 1}``): alias -> the ``nvext`` field it fills
NVEXT_ALIASES = {"steps": "num_inference_steps", "num_inference_steps": "num_inference_steps", "seed": "seed",
                 "guidance_scale": "guidance_scale", "negative_prompt": "negative_prompt"}

#: request knobs a client may send as extra top-level fields (OpenAI clients: ``extra_body``);
#: ``strength`` is i2i's (images with ``input_reference``): ``node_params.denoise.strength``
PASSTHROUGH_KNOBS = ("shift", "priority", "exact", "node_params", "plugin_params", *NVEXT_ALIASES, "strength")

_VIDEO_FIELDS = frozenset({
    "prompt", "model", "input_reference", "seconds", "size", "user", "response_format",
    "output_format", "stream", "nvext", "extra_args",
})
_VIDEO_NVEXT = frozenset({
    "annotations", "fps", "num_frames", "negative_prompt", "num_inference_steps", "guidance_scale",
    "seed", "boundary_ratio", "guidance_scale_2",
})
_IMAGE_NVEXT = frozenset({"annotations", "negative_prompt", "num_inference_steps", "guidance_scale", "seed"})
#: OpenAI image fields with no omniloop meaning: accepted and ignored when "auto"/unset
_IMAGE_IGNORED = ("quality", "style", "moderation", "background", "user")

#: omniloop field path -> the API field a client wrote (for error messages)
_FIELD_NAMES = {
    "diffusion.steps": "nvext.num_inference_steps",
    "diffusion.guidance_scale": "nvext.guidance_scale",
    "diffusion.seed": "nvext.seed",
    "diffusion.frames": "nvext.num_frames",
    "diffusion.fps": "nvext.fps",
    "diffusion.height": "size",
    "diffusion.width": "size",
    "diffusion.shift": "shift",
    "task": "input_reference",
    "node_params.denoise.strength": "strength",
}

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")


#: the longest clip a ``seconds`` field may ask for (the deploy's frame limit applies as well)
MAX_SECONDS = 3600.0


class InvalidRequest(ValueError):
    """A client error in a Dynamo media request. ``field`` is the API field (dotted).

    Field and message are capped and Unicode-safe (a client's 1 MB key or value is never echoed whole)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = cap_text(str(field), MAX_PATH_CHARS)
        self.message = cap_text(str(message), MAX_MESSAGE_CHARS)
        super().__init__(f"{self.field}: {self.message}" if self.field else self.message)


@define(frozen=True)
class MappedRequest:
    """A Dynamo request turned into omniloop requests (``n`` of them for images)."""

    kind: Literal["video", "image"]
    requests: list[OmniRequest]
    model: str
    response_format: Literal["url", "b64_json"]
    output_format: str
    stream: bool = False
    size: str | None = None
    ignored: list[str] = field(factory=list)


# --------------------------------------------------------------------------------------------
# Field helpers
# --------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite number (NaN, ±Infinity and ints too large for a float are not)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _opt_bounded(d: Mapping[str, Any], key: str, path: str, *, ok: Callable[[Any], bool], expected: str,
                 ge: float | None = None, gt: float | None = None) -> Any:
    """``d[key]`` (None when absent) if ``ok`` accepts it and it is ``>= ge`` / ``> gt``; else one
    :class:`InvalidRequest` at ``path``."""
    v = d.get(key)
    if v is None:
        return None
    if not ok(v):
        raise InvalidRequest(path, f"expected {expected}, got {brief(v)}")
    if ge is not None and v < ge:
        raise InvalidRequest(path, f"must be >= {ge}, got {v}")
    if gt is not None and v <= gt:
        raise InvalidRequest(path, f"must be > {gt}, got {v}")
    return v


def _opt_int(d: Mapping[str, Any], key: str, path: str, *, ge: int | None = None) -> int | None:
    v = _opt_bounded(d, key, path, ok=_is_int, expected="an integer", ge=ge)
    return None if v is None else int(v)


def _opt_num(d: Mapping[str, Any], key: str, path: str, *, ge: float | None = None, gt: float | None = None) -> float | None:
    v = _opt_bounded(d, key, path, ok=_is_num, expected="a finite number", ge=ge, gt=gt)
    return None if v is None else float(v)


def _opt_str(d: Mapping[str, Any], key: str, path: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise InvalidRequest(path, f"expected a string, got {type(v).__name__}")
    return v


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"832x480"`` -> (width 832, height 480); None -> (None, None) (the family's default)."""
    if size is None:
        return None, None
    if not isinstance(size, str):
        raise InvalidRequest("size", f"expected a string like '832x480', got {brief(size)}")
    m = _SIZE_RE.match(size)
    if not m:
        raise InvalidRequest("size", f"expected 'WIDTHxHEIGHT' like '832x480', got {brief(size)}")
    w, h = int(m.group(1)), int(m.group(2))
    if w < 1 or h < 1:
        raise InvalidRequest("size", f"width and height must be >= 1, got {size.strip()!r}")
    return w, h


def image_part(reference: Any, *, allow_local_files: bool) -> dict[str, Any]:
    """An ``input_reference`` as an omniloop image part.

    Accepted: a ``data:image/...;base64,`` URL or bare base64 data; a local path or ``file://``
    URL only when the worker runs with ``allow_local_files`` (a client naming files on the
    worker is otherwise refused). ``http(s)://`` URLs are not fetched by the worker.
    """
    if not isinstance(reference, str) or not reference.strip():
        raise InvalidRequest("input_reference", "expected a data: URL or base64-encoded image")
    ref = reference.strip()
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest("input_reference", "a data: URL must be base64 encoded (data:image/png;base64,...)")
        return {"type": "image", "data_b64": _checked_b64(data), "role": "first_frame"}
    lowered = ref.lower()
    if lowered.startswith(("http://", "https://")):
        raise InvalidRequest(
            "input_reference", "this worker does not fetch URLs; send the image as a data: URL or base64"
        )
    if lowered.startswith("file://") or ref.startswith(("/", "./", "~")):
        if not allow_local_files:
            raise InvalidRequest(
                "input_reference", "local file references are disabled on this worker; send a data: URL or base64"
            )
        path = ref[len("file://"):] if lowered.startswith("file://") else ref
        return {"type": "image", "path": path, "role": "first_frame"}
    return {"type": "image", "data_b64": _checked_b64(ref), "role": "first_frame"}


def _checked_b64(data: str) -> str:
    data = "".join(data.split())
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("input_reference", "is neither a data: URL nor valid base64") from None
    if not raw:
        raise InvalidRequest("input_reference", "the image data is empty")
    return data


def passthrough(request: Mapping[str, Any]) -> dict[str, Any]:
    """The client's extra top-level fields (``extra_args.media_passthrough``), checked."""
    extra = request.get("extra_args") or {}
    if not isinstance(extra, Mapping):
        raise InvalidRequest("extra_args", "expected an object")
    knobs = extra.get(MEDIA_PASSTHROUGH_KEY) or {}
    if not isinstance(knobs, Mapping):
        raise InvalidRequest("extra_args", "expected an object of extra fields")
    unknown = sorted(str(k) for k in knobs if k not in PASSTHROUGH_KNOBS)
    if unknown:
        names = ", ".join(repr(cap_text(k, 40)) for k in unknown[:5]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 5 else "")
        raise InvalidRequest(
            unknown[0], f"unknown request field{'s' if len(unknown) > 1 else ''} {names} "
            f"(omniloop accepts these extra fields: {', '.join(PASSTHROUGH_KNOBS)})",
        )
    return dict(knobs)


def fold_aliases(request: Mapping[str, Any], knobs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Move the alias knobs (:data:`NVEXT_ALIASES`) into a copy of the request's ``nvext``.

    Returns (the request with the merged ``nvext``, {``nvext.<field>``: the alias it came from}); a
    field set both ways is an error naming the alias."""
    nvext = request.get("nvext") or {}
    if not isinstance(nvext, Mapping):
        raise InvalidRequest("nvext", "expected an object")
    merged, origin = dict(nvext), {}
    for alias, target in NVEXT_ALIASES.items():
        if alias in knobs:
            value = knobs.pop(alias)
            if merged.get(target) is not None:
                also = origin.get(f"nvext.{target}", f"nvext.{target}")
                raise InvalidRequest(alias, f"given twice: also set as {also}")
            merged[target] = value
            origin[f"nvext.{target}"] = alias
    if not origin:
        return dict(request), origin
    return {**request, "nvext": merged}, origin


def _renamed(exc: InvalidRequest, origin: Mapping[str, str]) -> InvalidRequest:
    """An error about an aliased ``nvext`` field, named as the client wrote it."""
    return InvalidRequest(origin[exc.field], exc.message) if exc.field in origin else exc


def _response_format(request: Mapping[str, Any]) -> Literal["url", "b64_json"]:
    rf = request.get("response_format")
    if rf is None:
        return "url"  # the protocol's documented default
    if rf not in ("url", "b64_json"):
        raise InvalidRequest("response_format", f"must be 'url' or 'b64_json', got {brief(rf)}")
    return rf  # type: ignore[return-value]


#: the node whose ``strength`` i2i families read (FLUX.1, SD3)
STRENGTH_NODE = "denoise"


def _with_strength(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """``strength`` -> ``node_params.denoise.strength`` (merged with the client's node_params)."""
    out = dict(knobs)
    strength = out.pop("strength")
    node_params = out.get("node_params") or {}
    if not isinstance(node_params, Mapping) or not isinstance(node_params.get(STRENGTH_NODE, {}), Mapping):
        raise InvalidRequest("node_params", "expected an object of node parameter objects")
    denoise = dict(node_params.get(STRENGTH_NODE) or {})
    if "strength" in denoise:
        raise InvalidRequest("strength", f"given twice: also set as node_params.{STRENGTH_NODE}.strength")
    denoise["strength"] = strength
    out["node_params"] = {**node_params, STRENGTH_NODE: denoise}
    return out


def _build(data: dict[str, Any], knobs: Mapping[str, Any]) -> OmniRequest:
    """Apply the passthrough knobs and validate through omniloop's own schema."""
    if "shift" in knobs:
        data["diffusion"]["shift"] = knobs["shift"]
    for k in ("priority", "exact", "node_params", "plugin_params"):
        if k in knobs:
            data[k] = knobs[k]
    try:
        return request_from_dict(data)
    except RequestError as exc:
        raise InvalidRequest(api_field(exc.path), exc.message) from None


def api_field(path: str) -> str:
    """The API field name for an omniloop field path (``diffusion.steps`` -> ``nvext.num_inference_steps``)."""
    if path in _FIELD_NAMES:
        return _FIELD_NAMES[path]
    if path.startswith("inputs"):
        # the mapped inputs are [prompt, negative prompt (if any), image (if any)]
        parts = path.split(".")
        if len(parts) >= 3 and parts[2] == "text":
            return "prompt" if parts[1] == "0" else "nvext.negative_prompt"
        return "input_reference" if "image" in path or path.count(".") >= 1 else "prompt"
    return path


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def _common_fields(
    request: Any, what: str, allowed_nvext: frozenset[str],
) -> tuple[str, Mapping[str, Any], list[dict[str, Any]]]:
    """What video and image requests share: (model, nvext, the prompt and negative-prompt inputs)."""
    if not isinstance(request, Mapping):
        raise InvalidRequest("", f"{what} must be a JSON object")
    prompt = request.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt", "a text prompt is required")
    model = request.get("model")
    model = model if isinstance(model, str) else ""
    nvext = request.get("nvext") or {}
    if not isinstance(nvext, Mapping):
        raise InvalidRequest("nvext", "expected an object")
    unknown = sorted(str(k) for k in set(nvext) - allowed_nvext)
    if unknown:
        raise InvalidRequest(f"nvext.{cap_text(unknown[0], 40)}", "unknown field")
    inputs: list[dict[str, Any]] = [{"type": "text", "text": prompt, "role": "prompt"}]
    negative = _opt_str(nvext, "negative_prompt", "nvext.negative_prompt")
    if negative is not None:
        inputs.append({"type": "text", "text": negative, "role": "negative_prompt"})
    return model, nvext, inputs


def map_video_request(
    request: Mapping[str, Any], *, request_id: str, allow_local_files: bool = False,
    default_fps: float | None = None, video_tasks: tuple[str, str] = ("t2v", "i2v"),
) -> MappedRequest:
    """An ``NvCreateVideoRequest`` dict -> one omniloop t2v/i2v request.

    Frames: ``nvext.num_frames`` if given; else ``seconds * fps + 1`` (the first frame is t=0;
    Wan's 81 frames = 5 s at 16 fps) with ``fps`` from ``nvext.fps`` or the model's default;
    else the model's default frame count.
    """
    knobs = passthrough(request)
    request, origin = fold_aliases(request, knobs)
    try:
        return _map_video(request, knobs, request_id=request_id, allow_local_files=allow_local_files,
                          default_fps=default_fps, video_tasks=video_tasks)
    except InvalidRequest as exc:
        raise _renamed(exc, origin) from None


def _map_video(
    request: Mapping[str, Any], knobs: dict[str, Any], *, request_id: str, allow_local_files: bool,
    default_fps: float | None, video_tasks: tuple[str, str],
) -> MappedRequest:
    if "strength" in knobs:
        raise InvalidRequest("strength", "applies to image-to-image requests (images with input_reference) only")
    model, nvext, inputs = _common_fields(request, "a video request", _VIDEO_NVEXT)
    for name in ("boundary_ratio", "guidance_scale_2"):
        if nvext.get(name) is not None:
            raise InvalidRequest(
                f"nvext.{name}", "is not supported by omniloop workers (the expert boundary is the checkpoint's)"
            )
    width, height = parse_size(request.get("size"))
    fps = _opt_num(nvext, "fps", "nvext.fps", gt=0)
    frames = _opt_int(nvext, "num_frames", "nvext.num_frames", ge=1)
    if fps is not None and fps > MAX_FPS:
        raise InvalidRequest("nvext.fps", f"must be <= {MAX_FPS:g}, got {fps:g}")
    seconds = request.get("seconds")
    if seconds is not None and (not _is_num(seconds) or not 0 < seconds <= MAX_SECONDS):
        raise InvalidRequest("seconds", f"must be a number in (0, {MAX_SECONDS:g}], got {brief(seconds)}")
    if frames is None and seconds is not None:
        rate = fps if fps is not None else default_fps
        if rate is None:
            raise InvalidRequest("seconds", "this model has no default fps; give nvext.fps or nvext.num_frames")
        frames = round(float(seconds) * rate) + 1
    output_format = request.get("output_format") or "mp4"
    if output_format != "mp4":
        raise InvalidRequest("output_format", f"only 'mp4' is supported, got {brief(output_format)}")
    stream = request.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", f"expected true or false, got {brief(stream)}")
    task = video_tasks[0]
    if request.get("input_reference") is not None:
        inputs.append(image_part(request["input_reference"], allow_local_files=allow_local_files))
        task = video_tasks[1]
    diffusion = {
        "steps": _opt_int(nvext, "num_inference_steps", "nvext.num_inference_steps", ge=1),
        "guidance_scale": _opt_num(nvext, "guidance_scale", "nvext.guidance_scale", ge=0),
        "seed": _opt_int(nvext, "seed", "nvext.seed", ge=0),
        "frames": frames, "fps": fps, "width": width, "height": height,
    }
    data = {
        "task": task, "inputs": inputs, "request_id": request_id,
        "diffusion": {k: v for k, v in diffusion.items() if v is not None},
        "outputs": {"stream_progress": bool(stream)},
    }
    req = _build(data, knobs)
    return MappedRequest(
        kind="video", requests=[req], model=model, response_format=_response_format(request),
        output_format="mp4", stream=bool(stream), size=request.get("size"),
    )


def map_image_request(
    request: Mapping[str, Any], *, request_id: str, allow_local_files: bool = False, max_n: int = 10,
) -> MappedRequest:
    """An ``NvCreateImageRequest`` dict -> ``n`` omniloop t2i/i2i requests (seeds ``seed``, ``seed+1``, ...)."""
    knobs = passthrough(request)
    request, origin = fold_aliases(request, knobs)
    try:
        return _map_image(request, knobs, request_id=request_id, allow_local_files=allow_local_files, max_n=max_n)
    except InvalidRequest as exc:
        raise _renamed(exc, origin) from None


def _map_image(
    request: Mapping[str, Any], knobs: dict[str, Any], *, request_id: str, allow_local_files: bool, max_n: int,
) -> MappedRequest:
    model, nvext, inputs = _common_fields(request, "an image request", _IMAGE_NVEXT)
    n = _opt_int(request, "n", "n", ge=1) or 1
    if n > max_n:
        raise InvalidRequest("n", f"must be <= {max_n}, got {n}")
    width, height = parse_size(request.get("size"))
    output_format = request.get("output_format") or "png"
    if output_format != "png":
        raise InvalidRequest("output_format", f"only 'png' is supported, got {brief(output_format)}")
    ignored = [k for k in _IMAGE_IGNORED if request.get(k) not in (None, "auto")]
    task = "t2i"
    if request.get("input_reference") is not None:
        part = image_part(request["input_reference"], allow_local_files=allow_local_files)
        part["role"] = "image"
        inputs.append(part)
        task = "i2i"
    if "strength" in knobs:
        if task != "i2i":
            raise InvalidRequest("strength", "applies to image-to-image requests only (give input_reference)")
        knobs = _with_strength(knobs)
    seed = _opt_int(nvext, "seed", "nvext.seed", ge=0)
    base = {
        "steps": _opt_int(nvext, "num_inference_steps", "nvext.num_inference_steps", ge=1),
        "guidance_scale": _opt_num(nvext, "guidance_scale", "nvext.guidance_scale", ge=0),
        "width": width, "height": height,
        "frames": 1,  # one picture (a family that does t2i by a video of frames makes one frame), as omniloop serve asks
    }
    reqs = []
    for i in range(n):
        diffusion = {k: v for k, v in base.items() if v is not None}
        if seed is not None:
            diffusion["seed"] = seed + i
        data = {
            "task": task, "inputs": inputs, "diffusion": diffusion,
            "request_id": request_id if n == 1 else f"{request_id}-{i}",
            "outputs": {"stream_progress": False},
        }
        reqs.append(_build(data, knobs))
    return MappedRequest(
        kind="image", requests=reqs, model=model, response_format=_response_format(request),
        output_format="png", stream=False, size=request.get("size"), ignored=ignored,
    )


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def video_response(
    *, response_id: str, model: str, data: list[dict[str, Any]], created: int | None = None,
    inference_time_s: float | None = None, status: str = "completed", progress: int = 100,
    error: str | None = None,
) -> dict[str, Any]:
    """An ``NvVideosResponse`` dict (``object`` is always ``"video"``)."""
    out: dict[str, Any] = {
        "id": response_id, "object": "video", "model": model, "status": status, "progress": progress,
        "created": int(created if created is not None else time.time()), "data": data,
    }
    if error is not None:
        out["error"] = error
    if inference_time_s is not None:
        out["inference_time_s"] = round(float(inference_time_s), 6)
    return out


def video_data(*, url: str | None = None, b64_json: str | None = None, fps: float | None = None) -> dict[str, Any]:
    """A ``VideoData`` dict; ``output_format`` is required by the frontend."""
    d: dict[str, Any] = {"output_format": "mp4"}
    if url is not None:
        d["url"] = url
    if b64_json is not None:
        d["b64_json"] = b64_json
    if fps is not None:
        d["fps"] = round(fps)
    return d


def image_response(*, data: list[dict[str, Any]], size: str | None, created: int | None = None) -> dict[str, Any]:
    """An ``NvImagesResponse`` dict."""
    out: dict[str, Any] = {"created": int(created if created is not None else time.time()), "data": data,
                           "output_format": "png"}
    if size is not None:
        out["size"] = size
    return out


__all__ = [
    "PASSTHROUGH_KNOBS",
    "InvalidRequest",
    "MappedRequest",
    "api_field",
    "image_part",
    "image_response",
    "map_image_request",
    "map_video_request",
    "parse_size",
    "passthrough",
    "video_data",
    "video_response",
]
