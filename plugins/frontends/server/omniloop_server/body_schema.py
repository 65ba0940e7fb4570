"""The OpenAI-shaped request bodies as attrs classes: the one definition a body is validated with
(the core's converter, :func:`omniloop.schema.structure`, so errors name the body's dotted field:
``steps``, ``omniloop.diffusion.shift``) and ``/openapi.json`` is generated from
(:func:`omniloop_io.jsonschema.json_schema`, see :mod:`.openapi`).

A body field is one of

* an **alias** of an ``OmniRequest`` field (``steps = alias("diffusion.steps")``): its range
  metadata are that field's, its annotation must be that field's type (checked when this module is
  imported), and the mapping is generic (:func:`alias_values`: the value goes to the target, and an
  error the core raises later for the target is reported under the alias);
* an **OpenAI-specific** field the endpoint maps by hand (``size``, ``seconds``, ``image``,
  ``messages``...): typed and constrained here, its meaning in :mod:`.bodies`, :mod:`.images`, :mod:`.chat`;
* accepted for client compatibility without effect (``Any``).

The ``omniloop`` object (:class:`Omniloop`) is generated from ``OmniRequest`` itself: the fields in
:data:`OMNILOOP_FIELDS` with their types and metadata (``null`` = not given), ``request_id`` with
this server's narrower rule (it is a job name and a URL segment).
"""

# ruff: noqa: RUF009  (alias(), _ignored() ... return attrs.field(...): field definitions, not calls per instance)
from __future__ import annotations

import math
import re
import typing
from collections.abc import Mapping
from typing import Any, Literal

import attrs
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.request import AudioParams, DiffusionParams, OmniRequest, SamplingParams
from omniloop.schema import brief, structure

#: fields of the ``omniloop`` object a client may set (OmniRequest fields; the endpoint sets the task)
OMNILOOP_FIELDS = frozenset({"diffusion", "sampling", "outputs", "node_params", "plugin_params", "exact", "priority",
                             "request_id", "inputs", "negative_prompt", "adapters", "audio"})
#: a client-given job id: short and safe (it is metadata and a URL segment, never a file name)
REQUEST_ID_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,63}"
REQUEST_ID = re.compile(f"^{REQUEST_ID_PATTERN}$")
SIZE_PATTERN = r"\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*"
MAX_IMAGES = 10
#: the longest clip a body may ask for in seconds (the deploy's max_frames applies after)
MAX_SECONDS = 3600.0
_NUMBER_TEXT = re.compile(r"^ *[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)? *$")

_OWNERS: dict[str, type] = {"": OmniRequest, "diffusion": DiffusionParams, "sampling": SamplingParams,
                             "audio": AudioParams}


def _target_field(target: str) -> tuple[type, attrs.Attribute]:  # type: ignore[type-arg]
    owner, _, name = target.rpartition(".")
    cls = _OWNERS[owner]
    return cls, attrs.fields_dict(cls)[name]


def alias(target: str, description: str | None = None) -> Any:
    """A body field that is another name for the ``OmniRequest`` field ``target`` (dotted): its
    range metadata are the target's; ``None`` (or absent) means not given."""
    _, f = _target_field(target)
    return field(default=None, metadata={**f.metadata, "alias": target,
                                         "description": description or f"OmniRequest field {target}"})


# -- OpenAI-specific fields: the shapes a free-form field takes (checked by the converter) ------

_IMAGE_SCHEMA = {"anyOf": [{"type": "string", "description": "base64 image data or a data: URL"},
                           {"type": "object", "properties": {"image_url": {"type": "string"}},
                            "required": ["image_url"], "additionalProperties": False}]}


def seconds_value(v: Any) -> float | None:
    """``seconds`` as a number: a JSON number or a numeric string (OpenAI's SDK sends ``"4"``);
    None if it is neither (numeric text too large for a float is ``inf``: out of range, not "not a number")."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v) if _NUMBER_TEXT.match(v) else None
        except ValueError:  # never expected: the pattern is float()'s syntax
            v = None
    if not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def _check_seconds(v: Any) -> str | None:
    s = seconds_value(v)
    if s is None:
        return f"expected a number, got {_show(v)}"
    if not 0 < s <= MAX_SECONDS:
        return f"must be > 0 and at most {MAX_SECONDS:g}, got {_show(v)}"
    return None


def _show(v: Any) -> str:
    return brief(v)  # type and a short repr: client values are never echoed whole


def _ignored(description: str = "accepted for OpenAI client compatibility, without effect") -> Any:
    return field(default=None, metadata={"json_schema": {}, "description": description})


def _size() -> Any:
    return field(default=None, metadata={"pattern": SIZE_PATTERN, "description": "WIDTHxHEIGHT, e.g. 832x480",
                                         "pattern_hint": 'expected "WIDTHxHEIGHT" (e.g. "832x480")'})


def _images_n() -> Any:
    return field(default=None, metadata={"ge": 1, "le": MAX_IMAGES, "range_hint": f"must be between 1 and {MAX_IMAGES}",
                                         "description": "how many images (seeds seed + i)"})


# -- the omniloop object, generated from OmniRequest --------------------------------------------


def _omniloop_class() -> type:
    hints = typing.get_type_hints(OmniRequest)
    own = attrs.fields_dict(OmniRequest)
    these: dict[str, Any] = {}
    for name in sorted(OMNILOOP_FIELDS):
        if name in own:
            md = dict(own[name].metadata)
            if name == "request_id":  # this server's job names: shorter, never a path
                md.update(max_len=64, pattern=REQUEST_ID_PATTERN,
                          pattern_hint="must be 1-64 letters, digits or _ . : @ + = - (not starting with '.' or '-')")
            these[name] = attrs.field(type=hints[name] | None, default=None, metadata=md)
        else:  # a request_from_dict convenience (negative_prompt)
            these[name] = attrs.field(type=str | None, default=None)
    cls = attrs.make_class("Omniloop", these, frozen=True)
    cls.__doc__ = "OmniRequest fields passed through (the endpoint sets the task); null means not given."
    cls.__annotations__ = {k: v.type for k, v in these.items()}  # for typing.get_type_hints / the schema
    return cls


Omniloop = _omniloop_class()


# -- bodies --------------------------------------------------------------------------------------


@define(frozen=True, kw_only=True)
class DiffusionBody:
    """The fields every diffusion endpoint (videos, images, image edits) takes."""

    prompt: str
    negative_prompt: str | None = None
    model: str | None = field(default=None, metadata={"description": "the served model's id"})
    user: Any = _ignored()
    size: str | None = _size()
    steps: int | None = alias("diffusion.steps")
    num_inference_steps: int | None = alias("diffusion.steps", "diffusion.steps (diffusers' name)")
    guidance_scale: float | None = alias("diffusion.guidance_scale")
    seed: int | None = alias("diffusion.seed")
    priority: int | None = alias("priority")
    omniloop: Omniloop | None = None  # type: ignore[valid-type]


@define(frozen=True, kw_only=True)
class VideoCreate(DiffusionBody):
    """``POST /v1/videos``: t2v, or i2v with ``input_reference`` (or ``image``)."""

    seconds: Any = field(default=None, metadata={
        "check": _check_seconds, "description": "clip length; frames = seconds x fps",
        "json_schema": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SECONDS},
                                  {"type": "string", "pattern": _NUMBER_TEXT.pattern,
                                   "description": "a number of seconds in (0, 3600] as text, as OpenAI's SDK sends it"}]}})
    frames: int | None = alias("diffusion.frames")
    fps: float | None = alias("diffusion.fps")
    image: Any = field(default=None, metadata={"json_schema": _IMAGE_SCHEMA})
    input_reference: Any = field(default=None, metadata={"json_schema": _IMAGE_SCHEMA})


@define(frozen=True, kw_only=True)
class ImageCreate(DiffusionBody):
    """``POST /v1/images/generations``: ``n`` t2i requests."""

    n: int | None = _images_n()
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    quality: Any = _ignored()
    style: Any = _ignored()
    background: Any = _ignored()
    moderation: Any = _ignored()


@define(frozen=True, kw_only=True)
class ImageEdit(DiffusionBody):
    """``POST /v1/images/edits``: ``n`` i2i requests from one input image."""

    image: Any = field(metadata={"json_schema": _IMAGE_SCHEMA, "description": "the image to edit"})
    mask: Any = field(default=None, metadata={"json_schema": _IMAGE_SCHEMA, "description": "refused: no inpainting"})
    n: int | None = _images_n()
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    strength: float | None = field(default=None, metadata={
        "gt": 0.0, "le": 1.0, "description": "node_params.denoise.strength: how much of the schedule runs"})
    quality: Any = _ignored()
    style: Any = _ignored()
    background: Any = _ignored()
    moderation: Any = _ignored()
    input_fidelity: Any = _ignored()
    output_compression: Any = _ignored()
    safety_identifier: Any = _ignored()


# -- text bodies -----------------------------------------------------------------------------------

_NOOP_DESCRIPTION = "accepted only at its no-op value"
_STRS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}


def _noop() -> Any:
    return field(default=None, metadata={"json_schema": {}, "description": _NOOP_DESCRIPTION})


#: chat roles this server reads (``developer`` is ``system``), and how many messages a chat may hold
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 2048


def _check_role(role: str) -> str | None:
    if role in ("tool", "function"):
        return f"{role} messages are not supported (this server does no tool calling)"
    if role not in CHAT_ROLES:
        return f"expected one of {', '.join(CHAT_ROLES)}, got {_show(role)}"
    return None


def _no_tool_calls(v: Any) -> str | None:
    return None if v in (None, []) else "tool calls are not supported by this server"


def _check_messages(msgs: list[Any]) -> str | None:
    if not msgs:
        return "at least one message is required"
    if len(msgs) > MAX_MESSAGES:
        return f"at most {MAX_MESSAGES} messages, got {len(msgs)}"
    return None


_NO_TOOLS = {"description": "refused unless empty: no tool calling", "check": _no_tool_calls,
             "json_schema": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}}


@define(frozen=True, kw_only=True)
class ChatMessage:
    """One chat message: text only (``content`` a string or a list of ``text`` parts), no tool calls."""

    role: str = field(metadata={"check": _check_role, "json_schema": {"enum": list(CHAT_ROLES)}})
    content: Any = field(default=None, metadata={
        "description": "a string or a list of {type: text, text} parts; null only for an assistant message",
        "json_schema": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
            "required": ["type", "text"], "additionalProperties": False}}, {"type": "null"}]}})
    name: str | None = None
    tool_calls: Any = field(default=None, metadata=_NO_TOOLS)
    tool_call_id: Any = field(default=None, metadata={**_NO_TOOLS, "json_schema": {"type": "null"}})
    function_call: Any = field(default=None, metadata={**_NO_TOOLS, "json_schema": {"type": "null"}})
    refusal: Any = _ignored()


@define(frozen=True, kw_only=True)
class StreamOptions:
    """``stream_options`` of a streamed completion (only with ``stream: true``)."""

    include_usage: bool | None = field(default=None, metadata={"description": "a last chunk with usage"})
    include_obfuscation: bool | None = field(default=None, metadata={"description": "accepted, without effect"})
    continuous_usage_stats: bool | None = field(default=None, metadata={
        "description": "refused when true: usage comes in the last chunk"})


@define(frozen=True, kw_only=True)
class TextBody:
    """The fields both text endpoints take."""

    model: str | None = field(default=None, metadata={"description": "the served model's id"})
    max_tokens: int | None = alias("sampling.max_tokens")
    temperature: float | None = alias("sampling.temperature")
    top_p: float | None = alias("sampling.top_p")
    top_k: int | None = alias("sampling.top_k")
    seed: int | None = alias("sampling.seed")
    stop: Any = field(default=None, metadata={"json_schema": _STRS, "description": "sampling.stop (a string or a list)"})
    n: Any = field(default=None, metadata={"json_schema": {"anyOf": [{"enum": [1]}, {"type": "null"}]},
                                           "description": "only 1"})
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    omniloop: Omniloop | None = None  # type: ignore[valid-type]
    user: Any = _ignored()
    metadata: Any = _ignored()
    store: Any = _ignored()
    service_tier: Any = _ignored()
    parallel_tool_calls: Any = _ignored()
    prompt_cache_key: Any = _ignored()
    safety_identifier: Any = _ignored()
    frequency_penalty: Any = _noop()
    presence_penalty: Any = _noop()
    logprobs: Any = _noop()
    logit_bias: Any = _noop()


@define(frozen=True, kw_only=True)
class ChatCompletionCreate(TextBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = field(metadata={"check": _check_messages,
                                                  "json_schema_extra": {"minItems": 1, "maxItems": MAX_MESSAGES}})
    max_completion_tokens: int | None = alias("sampling.max_tokens", "sampling.max_tokens (OpenAI's newer name)")
    top_logprobs: Any = _noop()
    tools: Any = _noop()
    tool_choice: Any = _noop()
    functions: Any = _noop()
    function_call: Any = _noop()
    response_format: Any = _noop()


@define(frozen=True, kw_only=True)
class CompletionCreate(TextBody):
    """``POST /v1/completions``."""

    prompt: Any = field(metadata={"json_schema": {"anyOf": [{"type": "string"},
                                                            {"type": "array", "items": {"type": "string"}}]},
                                  "description": "a string (or a list of one)"})
    echo: Any = _noop()
    suffix: Any = _noop()
    best_of: Any = _noop()


# -- audio bodies (their endpoints: omniloop_server.audio) -----------------------------------------

#: what the audio endpoints return (``omniloop_io.media.AUDIO_ENCODINGS``)
AUDIO_RESPONSE_FORMATS = ("wav", "flac", "mp3", "opus", "aac", "pcm")


def _only_speed_one(v: Any) -> str | None:
    return None if v is None or v == 1 else f"only 1.0 (the model's own tempo), got {_show(v)}"


@define(frozen=True, kw_only=True)
class AudioBody:
    """The fields both audio endpoints take (a ``t2a`` request)."""

    model: str | None = field(default=None, metadata={"description": "the served model's id"})
    negative_prompt: str | None = None
    seconds: float | None = alias("audio.seconds", "audio.seconds: the clip's length (default: the model's maximum)")
    start: float | None = alias("audio.start", "audio.start: where the clip's window starts, in seconds")
    steps: int | None = alias("diffusion.steps")
    num_inference_steps: int | None = alias("diffusion.steps", "diffusion.steps (diffusers' name)")
    guidance: float | None = alias("diffusion.guidance_scale", "diffusion.guidance_scale")
    guidance_scale: float | None = alias("diffusion.guidance_scale")
    seed: int | None = alias("diffusion.seed")
    priority: int | None = alias("priority")
    omniloop: Omniloop | None = None  # type: ignore[valid-type]
    user: Any = _ignored()


@define(frozen=True, kw_only=True)
class SpeechCreate(AudioBody):
    """``POST /v1/audio/speech`` (OpenAI's shape): ``input`` is the prompt; the answer is the file."""

    input: str = field(metadata={"description": "the prompt: what the audio should be"})
    voice: Any = _ignored("required by OpenAI's SDK; a text-to-audio model has no voices: accepted, without effect")
    response_format: Literal["wav", "flac", "mp3", "opus", "aac", "pcm"] | None = field(default=None, metadata={
        "description": "the file type (default mp3, as OpenAI's); pcm: raw 16-bit little-endian samples, channels "
                       "interleaved, at the model's rate (the X-Sample-Rate and X-Channels headers say which)"})
    speed: float | None = field(default=None, metadata={"check": _only_speed_one, "description": "only 1.0",
                                                        "json_schema": {"anyOf": [{"enum": [1, 1.0]}, {"type": "null"}]}})
    instructions: str | None = field(default=None, metadata={
        "check": lambda v: None if not v else "instructions (voice control) are not supported by a text-to-audio "
                                              "model; put what the audio should be in input",
        "description": "refused unless empty: a text-to-audio model takes no voice instructions",
        "json_schema": {"anyOf": [{"enum": [""]}, {"type": "null"}]}})
    stream_format: Literal["audio"] | None = field(default=None, metadata={
        "description": "only audio (the whole file); sse is not supported"})


@define(frozen=True, kw_only=True)
class AudioGenerationCreate(AudioBody):
    """``POST /v1/audio/generations``: an audio job (poll it, then ``GET .../content``)."""

    prompt: str = field(metadata={"description": "what the audio should be"})
    response_format: Literal["wav", "flac", "mp3", "opus", "aac", "pcm"] | None = field(default=None, metadata={
        "description": "the file type of the job's content (default wav)"})


#: the body classes by OpenAPI schema name
BODY_CLASSES: dict[str, type] = {c.__name__: c for c in (VideoCreate, ImageCreate, ImageEdit, ChatCompletionCreate,
                                                         CompletionCreate, SpeechCreate, AudioGenerationCreate)}


def fields_of(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in attrs.fields(cls))


def _check_aliases() -> None:
    """Every alias is typed as its target (or its Optional): one source for both."""
    for cls in BODY_CLASSES.values():
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            target = f.metadata.get("alias")
            if target is None:
                continue
            owner, tf = _target_field(target)
            want = typing.get_type_hints(owner)[tf.name]
            if hints[f.name] not in (want, want | None):
                raise TypeError(f"{cls.__name__}.{f.name} aliases {target} ({want}) but is typed {hints[f.name]}")


_check_aliases()


# -- using them ------------------------------------------------------------------------------------


class InvalidBody(RequestError):
    """A body its class refuses (before anything is mapped or submitted); counted with the requests
    the engine refuses as invalid (``omniloop_requests_rejected_total{reason="invalid"}``)."""



def parse_body(body: Any, cls: type) -> Any:
    """Validate a body (already read, hostile input refused by ``bodies.check_tree``) against ``cls``;
    returns the structured body. :class:`RequestError` names the body's dotted field."""
    if body is None:
        raise RequestError("body", "the body is empty; expected a JSON object")
    if not isinstance(body, Mapping):
        raise RequestError("body", f"expected a JSON object, got {'an array' if isinstance(body, list) else type(body).__name__}")
    try:
        omni = body.get("omniloop")
        if isinstance(omni, Mapping):
            if "task" in omni:
                raise RequestError("omniloop.task", "the endpoint decides the task")
            if omni.get("inputs") is not None:
                check_http_inputs(omni["inputs"])
        for f in attrs.fields(cls):  # a list over its cap is refused before its items are structured
            cap = f.metadata.get("json_schema_extra", {}).get("maxItems")
            v = body.get(f.name)
            if cap is not None and isinstance(v, list) and len(v) > cap:
                raise RequestError(f.name, f.metadata["check"](v) if "check" in f.metadata else f"at most {cap} items")
        return structure(body, cls)
    except RequestError as exc:
        raise InvalidBody(exc.path, exc.message) from None


def check_http_inputs(inputs: Any) -> None:
    """Input parts from a client: data only, never a path on the server (a rule of this server, on
    top of the schema)."""
    if not isinstance(inputs, list):
        raise RequestError("omniloop.inputs", f"expected a list of input parts, got {_show(inputs)}")
    for i, part in enumerate(inputs):
        if not isinstance(part, Mapping):
            raise RequestError(f"omniloop.inputs.{i}", f"expected an object, got {_show(part)}")
        if "path" in part:
            raise RequestError(f"omniloop.inputs.{i}.path", "file paths on the server are not accepted over HTTP; send "
                               "the data (an image as data_b64, or input_reference)")
        if part.get("type") not in ("text", "image", "action"):
            raise RequestError(f"omniloop.inputs.{i}.type", "over HTTP an input part is text, image (data_b64) or action")


def alias_values(parsed: Any) -> list[tuple[str, str, Any]]:
    """``(body field, OmniRequest target, value)`` of every alias the body set; two aliases of one
    target (``steps`` and ``num_inference_steps``) is an error naming the second."""
    out: list[tuple[str, str, Any]] = []
    seen: dict[str, str] = {}
    for f in attrs.fields(type(parsed)):
        target = f.metadata.get("alias")
        value = getattr(parsed, f.name)
        if target is None or value is None:
            continue
        if target in seen:
            raise RequestError(f.name, f"given twice ({seen[target]} and {f.name})")
        seen[target] = f.name
        out.append((f.name, target, value))
    return out


def numeric_form_fields(*classes: type) -> tuple[frozenset[str], frozenset[str]]:
    """The top-level fields of ``classes`` typed int and float: what a multipart form's text is
    converted to before validation (OpenAI's SDK sends every form value as text)."""
    ints, floats = set(), set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for name, t in hints.items():
            if t in (int, int | None):
                ints.add(name)
            elif t in (float, float | None):
                floats.add(name)
    return frozenset(ints), frozenset(floats)


__all__ = [
    "AUDIO_RESPONSE_FORMATS",
    "BODY_CLASSES",
    "CHAT_ROLES",
    "MAX_IMAGES",
    "MAX_MESSAGES",
    "MAX_SECONDS",
    "OMNILOOP_FIELDS",
    "REQUEST_ID",
    "AudioBody",
    "AudioGenerationCreate",
    "ChatCompletionCreate",
    "ChatMessage",
    "CompletionCreate",
    "DiffusionBody",
    "ImageCreate",
    "ImageEdit",
    "InvalidBody",
    "Omniloop",
    "SpeechCreate",
    "StreamOptions",
    "TextBody",
    "VideoCreate",
    "alias",
    "alias_values",
    "check_http_inputs",
    "fields_of",
    "numeric_form_fields",
    "parse_body",
    "seconds_value",
]
