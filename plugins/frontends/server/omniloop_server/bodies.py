"""OpenAI-style request bodies → omniloop request dicts, with errors naming the *body's* field.

A body is validated first, against its attrs class in :mod:`.body_schema` — the classes
``/openapi.json`` is generated from, structured by the core's converter (types, ranges, unknown
fields; ``omniloop.diffusion.shift``-style paths). What is left here is the OpenAI-specific mapping:
``size: "WxH"`` → height/width, ``seconds`` → frames at the model's fps, an input image → an image
part, ``n`` → ``n`` requests; every *alias* (``steps``, ``guidance_scale``, ``seed``...) goes to the
OmniRequest field it names (:func:`.body_schema.alias_values`), and the ``omniloop`` object is merged
in as OmniRequest fields. Every mapped request field remembers the body field it came from, so a
:class:`RequestError` raised later (the core's schema, limits, family validation) is reported with
the path the client wrote: ``steps``, ``size``, ``omniloop.diffusion.shift``.

Hostile input is refused here, before anything else looks at it (:func:`check_tree`): nesting
deeper than :data:`MAX_DEPTH`, strings that are not valid Unicode (lone surrogates), integers
outside int64, non-finite numbers. Client-supplied strings never become file paths: the
``request_id`` a client may give is metadata checked against a short safe character set (files
are named by server-made ids, see :mod:`omniloop_server.jobs`), and input parts that name a file
on the server (``path``) are refused (:func:`.body_schema.check_http_inputs`).

``POST /v1/videos`` and ``POST /v1/images/edits`` also take ``multipart/form-data`` as OpenAI's SDK sends it
(:func:`form_to_body`): bracketed keys (``omniloop[diffusion][shift]``) nest, numbers arrive as
text and are converted, ``input_reference`` is an uploaded image file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from attrs import define, field

from omniloop.errors import RequestError
from omniloop.request import TaskType

from .body_schema import MAX_IMAGES as MAX_IMAGES  # re-exported (their old home)
from .body_schema import MAX_SECONDS as MAX_SECONDS
from .body_schema import OMNILOOP_FIELDS as OMNILOOP_FIELDS
from .body_schema import REQUEST_ID as REQUEST_ID
from .body_schema import (
    SIZE_PATTERN,
    DiffusionBody,
    ImageCreate,
    ImageEdit,
    VideoCreate,
    alias_values,
    fields_of,
    numeric_form_fields,
    parse_body,
    seconds_value,
)
from .jsonbody import BodyUnreadable, JsonProcesses, StringCaps, StringTooLong
from .jsonbody import decode as decode_json

_SIZE = re.compile(f"^{SIZE_PATTERN}$")

#: the body fields of each endpoint (its attrs class in :mod:`.body_schema` is the definition)
VIDEO_FIELDS = fields_of(VideoCreate)
IMAGE_FIELDS = fields_of(ImageCreate)
COMMON_FIELDS = fields_of(DiffusionBody)
#: deepest nesting of a body (objects and arrays); real bodies are 4 deep
MAX_DEPTH = 32
#: integers must fit int64 (seeds are the largest: < 2**63)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
#: the largest input image accepted (bytes, decoded)
MAX_IMAGE_BYTES = 16 * 1024 * 1024
#: the longest string echoed back in an error message
ECHO_CHARS = 80


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


def show(value: Any, limit: int = ECHO_CHARS) -> str:
    """A short, printable, valid-UTF-8 rendering of a client value for an error message."""
    if isinstance(value, (dict, list)):
        text = f"{type(value).__name__} of {len(value)}"
    else:
        try:
            text = repr(value)
        except (ValueError, RecursionError):  # ints over Python's str-conversion limit
            text = f"{type(value).__name__} (too long to show)"
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} chars)"


def name_of(key: Any, limit: int = 60) -> str:
    """A client-given field name as a printable path segment (truncated, valid UTF-8)."""
    text = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _err(path: str, msg: str) -> RequestError:
    return RequestError(path, msg)


# --------------------------------------------------------------------------------------------
# hostile-input checks
# --------------------------------------------------------------------------------------------


class BodyTooLarge(RequestError):
    """A body over its endpoint's byte limit (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__("body", f"body larger than {limit} bytes")
        self.limit = limit


def parse_json(raw: bytes | list[bytes], processes: JsonProcesses | None = None,
               process_bytes: int | None = None, *, check: bool = True, caps: StringCaps | None = None) -> Any:
    """Parse a JSON body (bytes, or its chunks as they arrived); raises :class:`RequestError` (path
    ``body``) for anything malformed.

    With ``processes``, a body of at least ``process_bytes`` is parsed in a helper process
    (:mod:`.jsonbody`: ``json.loads`` holds the GIL for the whole body, which would stall the
    event loop); the answer is the same either way. ``check``: :func:`check_tree` on the result.
    ``caps``: the longest string a field may hold (a longer one is a 422 naming it, checked in the
    helper process for a large body, so the string never exists in the server's process)."""
    try:
        size = len(raw) if isinstance(raw, bytes) else sum(map(len, raw))
        if processes is not None and process_bytes is not None and size >= process_bytes:
            body = processes.parse(raw, caps)
        else:
            body = decode_json(raw if isinstance(raw, bytes) else b"".join(raw), MAX_DEPTH)
            if caps is not None:
                caps.check(body)
    except BodyUnreadable as exc:
        raise _err("body", exc.message) from None
    except StringTooLong as exc:
        what = "an image (base64)" if exc.image else "text"
        why = "server.max_text_chars" if not exc.image else f"{MAX_IMAGE_BYTES} bytes decoded"
        raise _err(exc.path, f"a string of {exc.length} characters; {what} here is at most {exc.cap} ({why})") from None
    if check:  # (route extensions with their own value rules, e.g. ComfyUI's 64-bit unsigned seeds, skip it)
        check_tree(body)
    return body


def body_fingerprint(body: Any) -> str:
    """A digest of a parsed body (JSON or form; key order does not matter, uploaded files count by
    content): equal for a retried request, different for another one."""

    def default(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)):
            return {"bytes-sha256": hashlib.sha256(value).hexdigest()}
        raise TypeError(type(value).__name__)

    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=default, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_tree(body: Any) -> None:
    """Refuse what no field accepts, naming where: deep nesting, invalid Unicode, huge ints, NaN/Inf.

    Iterative (a deep body cannot exhaust the stack); every string, key included, is checked.
    """
    stack: list[tuple[Any, tuple[str, ...], int]] = [(body, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        where = ".".join(path) or "body"
        if isinstance(value, Mapping):
            if depth >= MAX_DEPTH:
                raise _err(where, f"nested too deeply (at most {MAX_DEPTH} levels)")
            for k, v in value.items():
                if not isinstance(k, str):
                    raise _err(where, f"field names must be strings, got {show(k)}")
                if not _valid_unicode(k):
                    raise _err(where, f"a field name is not valid Unicode (lone surrogate): {show(k)}")
                stack.append((v, (*path, k), depth + 1))
        elif isinstance(value, (list, tuple)):
            if depth >= MAX_DEPTH:
                raise _err(where, f"nested too deeply (at most {MAX_DEPTH} levels)")
            for i, v in enumerate(value):
                stack.append((v, (*path, str(i)), depth + 1))
        elif isinstance(value, str):
            if not _valid_unicode(value):
                raise _err(where, f"not valid Unicode (a lone surrogate): {show(value)}")
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                raise _err(where, "integer out of range (must fit in 64 bits)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _err(where, f"expected a finite number, got {show(value)}")
        elif not isinstance(value, (bytes, bytearray)):  # uploaded files (multipart) are bytes
            raise _err(where, f"unsupported value {type(value).__name__}")


def _valid_unicode(s: str) -> bool:
    if s.isascii():  # O(1) for str: no copy of a large string
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# multipart/form-data → body
# --------------------------------------------------------------------------------------------

_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")
_INT = re.compile(r"^[+-]?\d{1,19}$")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
#: top-level form fields converted from text: those the body classes type int / float
_INT_FIELDS, _FLOAT_FIELDS = numeric_form_fields(VideoCreate, ImageCreate, ImageEdit)
#: leaves under ``omniloop[...]`` that stay text even when they look like numbers
_TEXT_LEAVES = {"request_id", "prompt", "negative_prompt", "text", "data_b64", "role", "type"}
MAX_FORM_FIELDS = 64


def form_to_body(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The fields of a multipart form (as OpenAI's SDK encodes a body) → a JSON-like body.

    ``a[b][c]=v`` nests, ``a[]=v`` appends; top-level numeric fields are parsed from their text;
    leaves under ``omniloop[...]`` that read as JSON numbers or ``true``/``false``/``null`` are
    converted. ``omniloop`` may also be one field holding a JSON object. Uploaded files become
    ``bytes``.
    """
    body: dict[str, Any] = {}
    count = 0
    for key, raw in items:
        count += 1
        if count > MAX_FORM_FIELDS:
            raise _err("body", f"too many form fields (at most {MAX_FORM_FIELDS})")
        if not isinstance(key, str) or not _valid_unicode(key):
            raise _err("body", f"a form field name is not valid Unicode: {show(key)}")
        m = _KEY.match(key)
        if m is None:
            raise _err(name_of(key), "malformed form field name")
        name, rest = m.group(1), m.group(2)
        subs = re.findall(r"\[([^\[\]]*)\]", rest)
        if len(subs) >= MAX_DEPTH:
            raise _err(name, f"nested too deeply (at most {MAX_DEPTH} levels)")
        value = _form_value(name, subs, raw)
        _insert(body, [name, *subs], value, key)
    return body


def _form_value(name: str, subs: list[str], raw: Any) -> Any:
    if not isinstance(raw, str):  # an uploaded file (already read into bytes by the caller)
        return raw
    if not _valid_unicode(raw):
        raise _err(name, f"not valid Unicode: {show(raw)}")
    if not subs:
        if name == "omniloop" and raw.lstrip().startswith("{"):
            try:
                return parse_json(raw.encode("utf-8"))
            except RequestError as exc:  # name the form field, not the (readable) body
                raise _err("omniloop" if exc.path == "body" else f"omniloop.{exc.path}", exc.message) from None
        if name in _INT_FIELDS and _INT.match(raw.strip()):
            return int(raw)
        if name in _FLOAT_FIELDS and _FLOAT.match(raw.strip()):
            return float(raw)
        return raw
    leaf = next((s for s in reversed(subs) if s), name)
    if name == "omniloop" and leaf not in _TEXT_LEAVES:
        return _form_scalar(raw)
    return raw


def _form_scalar(raw: str) -> Any:
    s = raw.strip()
    if s in ("true", "false"):
        return s == "true"
    if s in ("null", ""):
        return None
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        v = float(s)
        return v if math.isfinite(v) else raw  # left as text: the schema names the field
    return raw


def _insert(body: dict[str, Any], keys: list[str], value: Any, original: str) -> None:
    node: Any = body
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        nxt = None if last else keys[i + 1]
        if isinstance(node, list):
            if k != "":
                raise _err(name_of(original), "mixes list and object form fields")
            if last:
                node.append(value)
                return
            child: Any = [] if nxt == "" else {}
            node.append(child)
            node = child
            continue
        if k == "":
            raise _err(name_of(original), "malformed form field name")
        if last:
            if k in node:
                raise _err(name_of(original), "given twice")
            node[k] = value
            return
        want: type = list if nxt == "" else dict
        if k not in node:
            node[k] = want()
        elif not isinstance(node[k], want):
            raise _err(name_of(original), "given both as a value and as nested fields")
        node = node[k]


# --------------------------------------------------------------------------------------------
# body → request dict
# --------------------------------------------------------------------------------------------


def _size(value: str) -> tuple[int, int]:
    m = _SIZE.match(value)
    if not m:  # never expected: the schema's pattern matched
        raise _err("size", f"expected \"WIDTHxHEIGHT\" (e.g. \"832x480\"), got {show(value)}")
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


def _set(d: dict[str, Any], target: str, value: Any) -> None:
    *parents, leaf = target.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def _base(body: Any, cls: type, task: TaskType, id_prefix: str) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], Any]:
    """Validate ``body`` against its class, then map what every diffusion body has: the prompts,
    ``size`` and the aliases (each to its OmniRequest field, remembered in ``origins``)."""
    b = parse_body(body, cls)
    d: dict[str, Any] = {"task": task.value, "request_id": f"{id_prefix}_{uuid.uuid4().hex[:24]}", "prompt": b.prompt}
    origins: dict[str, str] = {"inputs": "prompt", "task": "model", "prompt": "prompt"}
    info: dict[str, Any] = {"prompt": b.prompt}
    if b.negative_prompt is not None:
        d["negative_prompt"] = b.negative_prompt
        origins["negative_prompt"] = "negative_prompt"
    if b.size is not None:
        w, h = _size(b.size)
        d["diffusion"] = {"width": w, "height": h}
        origins["diffusion.width"] = origins["diffusion.height"] = "size"
        info["size"] = f"{w}x{h}"
    for name, target, value in alias_values(b):
        _set(d, target, value)
        origins[target] = name
    return d, origins, info, b


def _apply_omniloop(body: Mapping[str, Any], d: dict[str, Any], origins: dict[str, str]) -> None:
    """Merge the body's ``omniloop`` object (validated with the body: :class:`.body_schema.Omniloop`;
    ``null`` fields are not given) into the request dict."""
    extra = body.get("omniloop")
    if not isinstance(extra, Mapping):
        return
    given = {k: v for k, v in extra.items() if v is not None}
    if "request_id" in given:
        d.pop("request_id", None)  # the client names its job (an id, never a file name)
    _merge(d, given, origins)


def _image_bytes(name: str, value: Any) -> bytes:
    """An image given as uploaded bytes, base64, a data: URL or ``{"image_url": "data:..."}``."""
    if isinstance(value, Mapping):
        if "file_id" in value:
            raise _err(f"{name}.file_id", "file ids are not supported by this server; upload the image instead")
        if set(value) != {"image_url"}:
            raise _err(name, "expected an uploaded image file, base64 data, or {\"image_url\": \"data:...\"}")
        value = value["image_url"]
        name = f"{name}.image_url"
        if not isinstance(value, str) or not value.startswith("data:"):
            raise _err(name, f"only data: URLs are accepted (this server fetches nothing), got {show(value)}")
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str) and value:
        if value.startswith("data:"):
            value = value.split(",", 1)[-1]
        if len(value) > MAX_IMAGE_BYTES * 4 // 3 + 8:
            raise _err(name, f"image larger than {MAX_IMAGE_BYTES} bytes")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise _err(name, "is not valid base64 image data") from None
    else:
        raise _err(name, f"expected an image (uploaded file, base64 data or a data: URL), got {type(value).__name__} {show(value)}")
    if not data:
        raise _err(name, "the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise _err(name, f"image larger than {MAX_IMAGE_BYTES} bytes")
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            im.verify()
    except Exception as exc:  # any decoder error: it is not an image we can read
        raise _err(name, f"is not a readable image ({type(exc).__name__})") from None
    return data


def _fps_hint(body: Mapping[str, Any], diff: Mapping[str, Any], defaults: Mapping[str, Any]) -> float:
    fps = diff.get("fps")
    if fps is None:
        extra = body.get("omniloop")
        ediff = extra.get("diffusion") if isinstance(extra, Mapping) else None
        fps = ediff.get("fps") if isinstance(ediff, Mapping) else None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        fps = defaults.get("fps", 16.0)
    return float(fps)


def map_video_body(
    body: Any, *, tasks: frozenset[TaskType], defaults: Mapping[str, Any], temporal_scale: int | None,
    model: str = "this model",
) -> MappedBody:
    """``POST /v1/videos`` body → one request dict (t2v, or i2v with ``input_reference``/``image``)."""
    d, origins, info, b = _base(body, VideoCreate, TaskType.T2V, "video")
    if b.image is not None and b.input_reference is not None:
        raise _err("image", "give input_reference or image, not both")
    has_image = b.image is not None or b.input_reference is not None
    task = TaskType.I2V if has_image else TaskType.T2V
    d["task"] = task.value
    image_field = "image" if b.image is not None else "input_reference"
    if task not in tasks:
        does = ", ".join(sorted(t.value for t in tasks)) or "nothing"
        if has_image:
            raise _err(image_field, f"{model} cannot use an input image: it does not do i2v (it does: {does}); "
                       "serve an image-to-video checkpoint for input_reference")
        raise _err("model", f"{model} does not do t2v (it does: {does})")
    diff = d.setdefault("diffusion", {})
    if b.seconds is not None and b.frames is not None:
        raise _err("frames", "give seconds or frames, not both")
    if b.seconds is not None:
        seconds = seconds_value(b.seconds)  # the schema checked it is a number in (0, MAX_SECONDS]
        assert seconds is not None
        fps = _fps_hint(body, diff, defaults)
        frames = max(1, round(seconds * fps))
        if temporal_scale and temporal_scale > 1:  # e.g. Wan: 4k+1 frames
            frames = max(1, round((frames - 1) / temporal_scale)) * temporal_scale + 1
        diff["frames"] = frames
        origins["diffusion.frames"] = "seconds"
        info["seconds"] = b.seconds if isinstance(b.seconds, str) else f"{seconds:g}"
    if has_image:
        data = _image_bytes(image_field, body[image_field])
        d["inputs"] = [{"type": "image", "data_b64": base64.b64encode(data).decode("ascii"), "role": "first_frame"}]
        origins["inputs"] = image_field
    if not diff:
        d.pop("diffusion")
    _apply_omniloop(body, d, origins)
    return MappedBody([d], origins, info)


def expand_n(n: int | None, d: dict[str, Any], origins: dict[str, str], info: dict[str, Any]) -> MappedBody:
    """``n`` request dicts from one (request ids ``<id>_<i>``, seeds ``seed + i``)."""
    n = n or 1
    reqs = []
    base_id = d["request_id"]
    seed = d["diffusion"].get("seed") if isinstance(d.get("diffusion"), Mapping) else None
    for i in range(n):
        r = {**d, "request_id": f"{base_id}_{i}" if n > 1 else base_id}
        if isinstance(d.get("diffusion"), Mapping):
            r["diffusion"] = dict(d["diffusion"])
            if isinstance(seed, int) and not isinstance(seed, bool) and seed + i <= INT_MAX:
                r["diffusion"]["seed"] = seed + i
        reqs.append(r)
    info["n"] = n
    return MappedBody(reqs, origins, info)


def map_image_body(body: Any, *, tasks: frozenset[TaskType], model: str = "this model") -> MappedBody:
    """``POST /v1/images/generations`` body → ``n`` t2i request dicts (seeds ``seed + i``)."""
    d, origins, info, b = _base(body, ImageCreate, TaskType.T2I, "img")
    if TaskType.T2I not in tasks:
        raise _err("model", f"{model} does not generate images (no t2i task)")
    info["response_format"] = b.response_format or "b64_json"
    d.setdefault("diffusion", {}).setdefault("frames", 1)
    origins.setdefault("diffusion.frames", "omniloop.diffusion.frames")
    _apply_omniloop_images(body, d, origins)
    return expand_n(b.n, d, origins, info)


def _apply_omniloop_images(body: Mapping[str, Any], d: dict[str, Any], origins: dict[str, str]) -> None:
    extra = body.get("omniloop")
    if isinstance(extra, Mapping) and isinstance(extra.get("diffusion"), Mapping) and "frames" in extra["diffusion"]:
        d["diffusion"].pop("frames", None)  # an explicit frames wins over the image default
    _apply_omniloop(body, d, origins)
