"""``POST /v1/chat/completions`` and ``POST /v1/completions`` on a text (``reason``) deployment.

OpenAI-compatible bodies → one ``reason`` request each, run through the engine (so the ``step``
scheduler batches the decode steps of every running sequence: continuous batching):

=============================  ==================================================================
body field                     omniloop request
=============================  ==================================================================
``messages`` (chat)            ``inputs``: one text part per message, ``role`` system (also
                               ``developer``) / user / assistant; the family applies the chat
                               template. ``content`` is a string or a list of ``text`` parts.
``prompt`` (completions)       one text part with role ``prompt`` (no chat template)
``max_tokens`` /               ``sampling.max_tokens`` (one of the two)
``max_completion_tokens``
``temperature``, ``top_p``     ``sampling.temperature`` / ``sampling.top_p`` (``0`` is greedy; so
                               are ``temperature < 1e-4`` and ``top_p < 1e-6``)
``seed``, ``stop``             ``sampling.seed``, ``sampling.stop`` (a string or a list)
``top_k`` (``extra_body``)     ``sampling.top_k``
``omniloop`` (``extra_body``)  OmniRequest fields (``node_params``, ``plugin_params``, ``priority``)
=============================  ==================================================================

``n`` must be 1. Knobs we do not implement are refused with a 422 naming them unless they hold
their no-op value (``frequency_penalty: 0``, ``logprobs: false``, ``tools: []``, ...); ``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` are accepted without effect.

``stream: true`` answers server-sent events in OpenAI's chunk format (``chat.completion.chunk`` /
``text_completion``): the first chat chunk carries ``delta.role``, then one chunk per piece of text
the family releases (text that could still become a stop string is held back), then a chunk with
``finish_reason`` (``stop`` | ``length``), then — with ``stream_options.include_usage`` — a chunk
with empty ``choices`` and ``usage``, then ``data: [DONE]``. A failure after the stream started is
one ``data: {"error": {...}}`` event (the SDK raises it). A client that goes away cancels its
request at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from omniloop.errors import RequestError
from omniloop.request import EventKind, Status, TaskType

from .bodies import MappedBody, _apply_omniloop, name_of, show
from .body_schema import ChatCompletionCreate, CompletionCreate, alias_values, fields_of, parse_body

#: a message may hold at most this many content parts (the message count: body_schema.MAX_MESSAGES)
MAX_CONTENT_PARTS = 256
SSE_KEEPALIVE_S = 15.0
#: how often a non-streaming request checks that its client is still there
DISCONNECT_POLL_S = 0.5

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: accepted without effect
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}
#: accepted only at their no-op value (name → is the value a no-op?)
_NOOP = {
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "logit_bias": lambda v: v is None or v == {},
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
}
#: the body fields of each endpoint (their classes in :mod:`.body_schema` are the definition)
CHAT_FIELDS = fields_of(ChatCompletionCreate)
COMPLETION_FIELDS = fields_of(CompletionCreate)


def _err(path: str, msg: str) -> RequestError:
    return RequestError(path, msg)


def _content_text(i: int, content: Any) -> str:
    where = f"messages.{i}.content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise _err(where, f"at most {MAX_CONTENT_PARTS} content parts, got {len(content)}")
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise _err(f"{where}.{j}", f"expected a content part object, got {type(part).__name__} {show(part)}")
            kind = part.get("type")
            if kind != "text":
                raise _err(f"{where}.{j}.type", f"only text content is supported by this model, got {show(kind)}")
            unknown = sorted(k for k in part if k not in ("type", "text"))
            if unknown:
                raise _err(f"{where}.{j}.{name_of(unknown[0])}", "unknown field of a text part")
            text = part.get("text")
            if not isinstance(text, str):
                raise _err(f"{where}.{j}.text", f"expected a string, got {type(text).__name__} {show(text)}")
            texts.append(text)
        return "\n".join(texts)
    raise _err(where, f"expected a string or a list of text parts, got {type(content).__name__} {show(content)}")


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Validated :class:`.body_schema.ChatMessage` objects → text parts (the chat template's roles)."""
    parts = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise _err(f"messages.{i}.content", "missing required field")
            content = ""
        parts.append({"type": "text", "text": _content_text(i, content), "role": _ROLES[m.role]})
    return parts


def _prompt(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "prompt" not in body:
        raise _err("prompt", "missing required field")
    p = body["prompt"]
    if isinstance(p, list):
        if len(p) != 1 or not isinstance(p[0], str):
            raise _err("prompt", "expected a string (or a list of one string; token-id prompts and batches are not supported)")
        p = p[0]
    if not isinstance(p, str):
        raise _err("prompt", f"expected a string, got {type(p).__name__} {show(p)}")
    return [{"type": "text", "text": p, "role": "prompt"}]


def _stream_flags(b: Any) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a validated text body (its types are the schema's)."""
    stream, opts = bool(b.stream), b.stream_options
    if opts is None:
        return stream, False
    if not stream:
        raise _err("stream_options", "only allowed when stream is true")
    if opts.continuous_usage_stats:
        raise _err("stream_options.continuous_usage_stats", "not supported (usage comes in the last chunk)")
    return stream, bool(opts.include_usage)


def map_text_body(body: Any, *, chat: bool, tasks: frozenset[TaskType], model: str = "this model") -> MappedBody:
    """A chat (``chat=True``) or completions body → one ``reason`` request dict.

    The body is validated against :class:`.body_schema.ChatCompletionCreate` /
    :class:`.body_schema.CompletionCreate` (types, ranges of the sampling aliases, unknown fields);
    ``info`` carries ``stream``, ``include_usage`` and the response ``id``."""
    b = parse_body(body, ChatCompletionCreate if chat else CompletionCreate)
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    if TaskType.REASON not in tasks:
        does = ", ".join(sorted(t.value for t in tasks)) or "nothing"
        what = "chat completions" if chat else "text completions"
        raise _err("model", f"{model} does not generate text, so it serves no {what} (it does: {does})")
    for name, ok in _NOOP.items():
        if name in body and name in allowed and not ok(body[name]):
            raise _err(name, f"not supported by this server (got {show(body[name])}; only its default is accepted)")
    if b.n is not None and (isinstance(b.n, bool) or b.n != 1 or not isinstance(b.n, int)):
        raise _err("n", f"only n=1 is supported, got {show(b.n)}")
    stream, include_usage = _stream_flags(b)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    inputs = _messages(b.messages) if chat else _prompt(body)
    d: dict[str, Any] = {"task": TaskType.REASON.value, "request_id": rid, "inputs": inputs}
    origins: dict[str, str] = {"inputs": "messages" if chat else "prompt", "task": "model", "request_id": "body"}
    sampling: dict[str, Any] = {}
    for name, target, value in alias_values(b):  # max_tokens, temperature, top_p, top_k, seed
        sampling[target.split(".", 1)[1]] = value
        origins[target] = name
    if b.stop is not None:
        sampling["stop"] = [b.stop] if isinstance(b.stop, str) else b.stop
        origins["sampling.stop"] = "stop"
    if sampling:
        d["sampling"] = sampling
    if stream:
        d["outputs"] = {"stream_partial": True, "stream_progress": False}
        origins["outputs"] = "stream"
    _apply_omniloop(body, d, origins)
    return MappedBody([d], origins, {"stream": stream, "include_usage": include_usage, "id": rid})


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------


def _usage(out: Any) -> dict[str, int]:
    u = out.metrics.get("usage") or {}
    p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": int(u.get("total_tokens", p + c))}


def _finish(out: Any) -> str:
    reason = out.metrics.get("finish_reason")
    return reason if reason in ("stop", "length") else "stop"


def completion_object(out: Any, *, chat: bool, rid: str, model: str, created: int) -> dict[str, Any]:
    """The whole (non-streamed) answer as OpenAI's ``chat.completion`` / ``text_completion``."""
    text = out.artifacts["text"].text
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                  "finish_reason": _finish(out), "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": _finish(out), "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(out), "system_fingerprint": None}


def _chunk(chat: bool, rid: str, model: str, created: int, *, text: str | None = None, role: bool = False,
           finish: str | None = None, usage: dict[str, int] | None = None, with_usage: bool = False) -> bytes:
    if usage is not None:
        choices: list[dict[str, Any]] = []
    elif chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": choices, "system_fingerprint": None}
    if with_usage:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _error_event(message: str, type_: str, code: str) -> bytes:
    return f"data: {json.dumps({'error': {'message': message, 'type': type_, 'param': None, 'code': code}})}\n\n".encode()


def _failure(out: Any) -> tuple[int, str, str, str]:
    """(status, message, type, code) of an output that did not complete."""
    if out.status is Status.CANCELLED:
        return 503, "the request was cancelled (the server is shutting down)", "server_error", "cancelled"
    msg = out.error.message if out.error else out.status.value
    return 500, f"text generation {out.status.value}: {msg}", "server_error", out.status.value


async def stream_events(engine: Any, handle: Any, *, chat: bool, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion (see the module docstring); cancels on disconnect."""
    rid, created = handle.request_id, int(time.time())
    it = handle.events().__aiter__()
    nxt: asyncio.Future[Any] | None = None
    out = None
    try:
        if chat:
            yield _chunk(chat, rid, model, created, text="", role=True, with_usage=include_usage)
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=SSE_KEEPALIVE_S)
            if not done:
                while not done:  # queued behind other work: keep the connection alive
                    yield b": keep-alive\n\n"
                    done, _ = await asyncio.wait({nxt}, timeout=SSE_KEEPALIVE_S)
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                break
            finally:
                nxt = None
            if ev.kind is EventKind.PARTIAL and ev.artifact == "text":
                piece = getattr(ev.value, "text", "")
                if piece:
                    yield _chunk(chat, rid, model, created, text=piece, with_usage=include_usage)
            elif ev.kind is EventKind.FINAL:
                out = ev.output
                break
        out = out or await handle.result()
        if not out.ok:
            _, msg, type_, code = _failure(out)
            yield _error_event(msg, type_, code)
            return
        yield _chunk(chat, rid, model, created, text="" if not chat else None, finish=_finish(out),
                     with_usage=include_usage)
        if include_usage:
            yield _chunk(chat, rid, model, created, usage=_usage(out), with_usage=True)
        yield b"data: [DONE]\n\n"
    finally:
        if nxt is not None:
            nxt.cancel()
        if not handle.done():  # the client went away (or the server stops): free the sequence
            engine.cancel(rid)
        else:
            engine.forget(rid)


async def wait_result(engine: Any, handle: Any, request: Request) -> Any:
    """The output; cancels the request when the client disconnects while it waits."""
    while True:
        try:
            return await handle.result(timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                engine.cancel(handle.request_id)
                return await handle.result()


def text_routes(api: Any) -> list[Any]:
    """The routes, built on the app's helpers (``api``: see :func:`omniloop_server.app.create_app`)."""
    from starlette.routing import Route

    from .app import error

    state, engine = api.state, api.engine

    def make(chat: bool) -> Any:
        async def endpoint(request: Request) -> Response:
            mapped = None
            try:
                body = await api.read_request_body(request, form=False, text=True)
                if state.draining:
                    return api.closed()
                mapped = await state.off_loop(lambda: map_text_body(body, chat=chat, tasks=state.tasks,
                                                                    model=repr(state.model_id)))
                state.check_model(body)
                (handle,) = await api.submit(mapped)
            except Exception as exc:
                return api.translate(exc, mapped)
            state.track([handle])
            model = state.model_id
            if mapped.info["stream"]:
                return StreamingResponse(
                    stream_events(engine, handle, chat=chat, model=model, include_usage=mapped.info["include_usage"]),
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": handle.request_id})
            out = await wait_result(engine, handle, request)
            engine.forget(handle.request_id)
            if not out.ok:
                status, msg, type_, code = _failure(out)
                if state.draining:  # cut by the shutdown
                    status, type_, code = 503, "server_error", "shutting_down"
                return error(status, msg, type_=type_, code=code)
            return JSONResponse(completion_object(out, chat=chat, rid=handle.request_id, model=model,
                                                  created=int(handle.submitted_at)))

        return endpoint

    return [
        Route("/v1/chat/completions", make(True), methods=["POST"]),
        Route("/v1/completions", make(False), methods=["POST"]),
    ]
