"""``WS /v1/videos/stream``: a video streamed chunk by chunk over a WebSocket (issue 21).

For streaming deployments (Wan with ``options.rollout: causal``): every PARTIAL ``VideoFrames``
event is sent the moment its chunk is decoded. Other video deployments answer the same protocol
with progress messages and the whole clip as one chunk at the end.

Protocol (JSON text messages, except the frames)::

    client -> {"type": "start", <the fields of POST /v1/videos>}     first message ("type" optional)
    server -> {"type": "accepted", "id", "request": n}
    server -> {"type": "progress", "id", "node", "step", "total"}     ...
    server -> {"type": "chunk", "id", "chunk", "first_frame", "frames", "height", "width", "fps",
               "format": "rgb24"}
    server -> <binary: frames*height*width*3 bytes, uint8 RGB, frame-major (the chunk's frames)>
    server -> {"type": "done", "id", "status", "frames", "session", "error"}
    client -> {"type": "continue", "prompt": "...", ["frames" | "seconds"]}   after "done": the
              next chunks of the same video with a new prompt (node_params.rollout.session);
              at most :data:`MAX_REQUESTS` requests per connection
    client -> {"type": "cancel"}    stop the running request (its "done" says cancelled; the
              session is closed: a later "continue" is refused)
    client -> {"type": "close"}     (or just disconnect)

A bad message gets ``{"type": "error", "error": {message, type, param, code}}`` (OpenAI's error
object; ``param`` the body field) and the socket is closed (code 1008; 1009 for a message over
:data:`MAX_MESSAGE_BYTES`, 1013 when the server is draining). A socket idle between requests is closed (1001) when
the server starts draining. A message while a request runs that
is not "cancel" gets an error message without closing. A client that disconnects cancels its
running request (it stops at the next chunk boundary; its KV slabs are freed) and its session is
closed. The server owns ``node_params.rollout`` on this endpoint (a client value is refused).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from omniloop.artifacts import VideoFrames
from omniloop.errors import RequestError
from omniloop.request import EventKind

from .bodies import map_video_body, parse_json

log = logging.getLogger("omniloop.server")

MAX_MESSAGE_BYTES = 1024 * 1024
#: requests (the start and its continues) on one connection
MAX_REQUESTS = 32
CONTINUE_FIELDS = {"prompt", "frames", "seconds"}
#: how often a socket idle between requests checks whether the server drains (then it is closed, 1001)
IDLE_POLL_S = 0.5


class _Refused(Exception):
    def __init__(self, message: str, param: str | None = "body", code: str = "invalid_request_error",
                 close: int = 1008) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.close_code = message, param, code, close


def _causal(runtime: Any) -> bool:
    """Whether the deployment as loaded streams causal sessions: the runtime's resolved options
    (the preset's ``omniloop.json`` under the deploy's own ``options``), not the deploy file alone
    — ``preset: wan-demo-causal`` is causal without a word about it in the deploy."""
    opts = getattr(runtime, "options", None)
    if not isinstance(opts, dict):
        opts = getattr(getattr(runtime, "deploy", None), "options", None) or {}
    return isinstance(opts, dict) and opts.get("rollout") == "causal"


#: errors of a request that found no room (the KV pool, the session store): retried later, they may pass
_NO_ROOM = {"CacheFull", "SessionLimit"}


def _close_session(runtime: Any, sid: str, height: int, width: int) -> None:
    """Free a kept causal session (its slabs and VAE cache); a no-op when it is gone already."""
    model = getattr(runtime, "model", None)
    dep = (getattr(model, "config", None) or {}).get("causal")
    if dep is None or not hasattr(dep, "engine"):
        return
    try:
        dep.engine(height, width)[1].close(sid)
    except Exception:  # never let freeing fail the socket's teardown
        log.warning("closing causal session %s failed", sid, exc_info=True)


def _session_share(runtime: Any, sid: str, height: int, width: int) -> float | None:
    """The share of its KV pool a kept causal session holds (its slabs / the pool's); None if unknown."""
    model = getattr(runtime, "model", None)
    dep = (getattr(model, "config", None) or {}).get("causal")
    if dep is None or not hasattr(dep, "engine"):
        return None
    try:
        eng, store = dep.engine(height, width)
        sess = store.get(sid)
        return eng.slabs_for(sess.chunks, bool(sess.stream.cfg)) / max(1, eng.manager.num_blocks)
    except Exception:  # gone, expired: the continue will say so
        return None


def _raw(frames: Any) -> bytes:
    """``[n, H, W, 3]`` uint8 frames as bytes (frame-major, RGB)."""
    return bytes(frames.contiguous().cpu().numpy().tobytes())


class SessionSlots:
    """The causal sessions WebSockets keep, counted per server and per client address: a cap below
    the KV pool (room stays for one-off streams and POST /v1/videos) and a per-client share. A
    session is bound to its socket (its id is never accepted from a client), so the slot is held
    from the start message until the socket ends."""

    def __init__(self, cap: int, per_client: int) -> None:
        self.cap, self.per_client = cap, per_client
        self.by_client: dict[str, int] = {}

    @property
    def open(self) -> int:
        return sum(self.by_client.values())

    def claim(self, client: str) -> str | None:
        """Take a slot for ``client``; the refusal's message when there is none."""
        if self.open >= self.cap:
            return f"all {self.cap} stream sessions of this server are in use (deploy server.max_sessions); retry later"
        if self.by_client.get(client, 0) >= self.per_client:
            return (f"this client already holds {self.per_client} stream session(s) (deploy "
                    "server.max_sessions_per_client); close one first")
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        n = self.by_client.get(client, 0) - 1
        if n > 0:
            self.by_client[client] = n
        else:
            self.by_client.pop(client, None)


def video_stream_routes(api: Any) -> list[Any]:
    state, engine = api.state, api.engine
    opts = api.options
    sessions = state.ws_sessions = SessionSlots(opts.max_sessions, opts.max_sessions_per_client)

    def error_payload(exc: Exception, mapped: Any) -> tuple[dict[str, Any], int]:
        if isinstance(exc, _Refused):
            return {"message": exc.message, "type": "invalid_request_error", "param": exc.param,
                    "code": exc.code}, exc.close_code
        resp = api.translate(exc, mapped)  # the same mapping (and messages) as POST /v1/videos
        body = json.loads(resp.body)
        close = 1013 if resp.status_code in (429, 503) else 1008
        retry = resp.headers.get("retry-after")
        if retry is not None:  # no room now (queue, KV pool): the HTTP answer's Retry-After as a field
            body["error"]["retry_after_s"] = int(retry)
        return body["error"], close

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        send_lock = asyncio.Lock()
        sid: str | None = None
        size: tuple[int, int] | None = None
        recv: asyncio.Task[Any] | None = None
        handle = None

        async def send_json(obj: dict[str, Any]) -> None:
            async with send_lock:
                await ws.send_text(json.dumps(obj))

        async def read() -> dict[str, Any] | None:
            """The next client message as a dict; None on disconnect; _Refused when unreadable."""
            nonlocal recv
            if recv is None:
                recv = asyncio.ensure_future(ws.receive())
            msg = await recv
            recv = None
            return _decode(msg)

        def _decode(msg: dict[str, Any]) -> dict[str, Any] | None:
            if msg["type"] == "websocket.disconnect":
                return None
            raw = msg.get("bytes") if msg.get("text") is None else msg["text"].encode("utf-8", "surrogatepass")
            if raw is None:
                raw = b""
            if len(raw) > MAX_MESSAGE_BYTES:
                raise _Refused(f"message larger than {MAX_MESSAGE_BYTES} bytes", close=1009)
            body = parse_json(raw)
            if not isinstance(body, dict):
                raise _Refused(f"expected a JSON object, got {type(body).__name__}")
            return body

        async def build(body: dict[str, Any], rollout: dict[str, Any] | None) -> tuple[Any, Any]:
            mapped = None
            try:
                omni = body.get("omniloop")
                if isinstance(omni, dict) and isinstance(omni.get("node_params"), dict) \
                        and "rollout" in omni["node_params"]:
                    raise RequestError("omniloop.node_params.rollout",
                                       "the stream endpoint manages sessions itself (use a 'continue' message)")
                mapped = await state.off_loop(lambda: map_video_body(
                    body, tasks=state.tasks, defaults=state.video_defaults, temporal_scale=state.temporal_scale,
                    model=repr(state.model_id)))
                state.check_model(body)
                (r,) = mapped.requests
                r["request_id"] = f"ws-{secrets.token_hex(12)}"
                if rollout is not None:
                    r.setdefault("node_params", {})["rollout"] = rollout
                if _causal(state.runtime):  # the chunks are what this endpoint sends (a non-streaming
                    r.setdefault("outputs", {})["stream_partial"] = True  # rollout refuses partials: issue 34)
                (h,) = await api.submit(mapped)
            except Exception as exc:
                return None, error_payload(exc, mapped)
            state.track([h])
            return h, None

        async def pump(h: Any) -> dict[str, Any]:
            """Send the request's events; return its "done" message."""
            nonlocal size
            chunk = first = 0
            async for ev in h.events():
                if ev.kind is EventKind.PROGRESS and ev.total and ev.step is not None:
                    await send_json({"type": "progress", "id": h.request_id, "node": ev.node, "step": ev.step,
                                     "total": ev.total})
                elif ev.kind is EventKind.PARTIAL and isinstance(ev.value, VideoFrames):
                    frames = ev.value.frames
                    n, height, width = int(frames.shape[0]), int(frames.shape[1]), int(frames.shape[2])
                    size = (height, width)
                    data = await asyncio.to_thread(_raw, frames)
                    async with send_lock:
                        await ws.send_text(json.dumps({
                            "type": "chunk", "id": h.request_id, "chunk": chunk, "first_frame": first, "frames": n,
                            "height": height, "width": width, "fps": float(ev.value.fps), "format": "rgb24"}))
                        await ws.send_bytes(data)
                    chunk += 1
                    first += n
            out = await h.result()
            video = out.artifacts.get("video")
            if chunk == 0 and isinstance(video, VideoFrames) and video.frames is not None:  # not a streaming
                frames = video.frames                                                        # deployment
                size = (int(frames.shape[1]), int(frames.shape[2]))
                data = await asyncio.to_thread(_raw, frames)
                async with send_lock:
                    await ws.send_text(json.dumps({
                        "type": "chunk", "id": h.request_id, "chunk": 0, "first_frame": 0,
                        "frames": int(frames.shape[0]), "height": size[0], "width": size[1],
                        "fps": float(video.fps), "format": "rgb24"}))
                    await ws.send_bytes(data)
                first = int(frames.shape[0])
            err = out.error
            done = {"type": "done", "id": h.request_id, "status": out.status.value, "frames": first,
                    # a request cancelled or failed (mid-stream or refused) ends its session: none to continue
                    "session": out.metrics.get("session") if out.ok else None,
                    "error": None if err is None else {"message": err.message, "type": err.type, "node": err.node}}
            if err is not None and err.type in _NO_ROOM:
                done["error"]["retry_after_s"] = opts.retry_after_s
            return done

        async def fail(payload: dict[str, Any], close: int) -> None:
            try:
                await send_json({"type": "error", "error": payload})
                await ws.close(close)
            except Exception:
                pass

        causal = _causal(state.runtime)
        requests = 0
        start: dict[str, Any] | None = None
        client = ws.client.host if ws.client is not None else "?"
        slot = False  # this connection holds one of the server's session slots
        try:
            try:
                body = await asyncio.wait_for(read(), opts.ws_start_timeout_s)
            except (_Refused, RequestError) as exc:
                await fail(*error_payload(exc, None))
                return
            except TimeoutError:
                await fail({"message": f"no start message within {opts.ws_start_timeout_s:g} s", "type": "invalid_request_error",
                            "param": "type", "code": "start_timeout"}, 1008)
                return
            if body is None:
                return
            if state.draining:
                await fail({"message": "the server is shutting down and takes no new streams", "type": "server_error",
                            "param": None, "code": "shutting_down"}, 1013)
                return
            kind = body.pop("type", "start")
            if kind != "start":
                await fail({"message": f"the first message must be a start message, got type {str(kind)[:40]!r}",
                            "type": "invalid_request_error", "param": "type", "code": "invalid_request_error"}, 1008)
                return
            start = body
            keep = causal and opts.max_sessions > 0
            if keep:
                why = sessions.claim(client)
                if why is not None:
                    await fail({"message": why, "type": "rate_limit_error", "param": None, "code": "sessions_full",
                                "retry_after_s": opts.retry_after_s}, 1013)
                    return
                slot = True
            handle, bad = await build(body, {"keep_session": True} if keep else None)
            while True:
                if bad is not None:
                    await fail(*bad)
                    return
                requests += 1
                await send_json({"type": "accepted", "id": handle.request_id, "request": requests})
                task = asyncio.ensure_future(pump(handle))
                while not task.done():
                    if recv is None:
                        recv = asyncio.ensure_future(ws.receive())
                    await asyncio.wait({task, recv}, return_when=asyncio.FIRST_COMPLETED)
                    if recv.done() and not task.done():
                        try:
                            msg = await read()
                        except (_Refused, RequestError) as exc:
                            payload, _ = error_payload(exc, None)
                            await send_json({"type": "error", "error": payload})
                            continue
                        if msg is None:  # gone: cancel; the finally below frees the session
                            engine.cancel(handle.request_id)
                            task.cancel()
                            return
                        if msg.get("type") == "cancel":
                            engine.cancel(handle.request_id)
                        else:
                            await send_json({"type": "error", "error": {
                                "message": "a request is running: wait for its 'done' (or send 'cancel')",
                                "type": "invalid_request_error", "param": "type", "code": "busy"}})
                done = task.result()
                handle = None
                if done["session"]:
                    sid = done["session"]
                elif sid is not None:  # cancelled / failed / refused: the session ends here, never leaks
                    if size is not None:  # (a continuation refused before it ran left it open: close it)
                        _close_session(state.runtime, sid, *size)
                    sid = None
                await send_json(done)
                # the next message: continue, or close (a draining server closes idle sockets; an
                # idle socket is closed after ws_idle_timeout_s, freeing its session)
                if recv is None:
                    recv = asyncio.ensure_future(ws.receive())
                idle_until = asyncio.get_running_loop().time() + opts.ws_idle_timeout_s
                while not recv.done() and not state.draining and asyncio.get_running_loop().time() < idle_until:
                    await asyncio.wait({recv}, timeout=IDLE_POLL_S)
                if not recv.done():
                    if state.draining:
                        await fail({"message": "the server is shutting down; the stream ends here", "type": "server_error",
                                    "param": None, "code": "shutting_down"}, 1001)
                    else:
                        await fail({"message": f"idle for {opts.ws_idle_timeout_s:g} s: the stream ends here (its "
                                    "session is closed)", "type": "invalid_request_error", "param": None,
                                    "code": "idle_timeout"}, 1001)
                    return
                try:
                    msg = await read()
                except (_Refused, RequestError) as exc:
                    await fail(*error_payload(exc, None))
                    return
                if msg is None or msg.get("type") == "close":
                    await ws.close(1000) if msg is not None else None
                    return
                if msg.get("type") != "continue":
                    await fail({"message": f"expected a continue or close message, got type {str(msg.get('type'))[:40]!r}",
                                "type": "invalid_request_error", "param": "type", "code": "invalid_request_error"}, 1008)
                    return
                if sid is None:
                    await fail({"message": "nothing to continue: this deployment does not stream sessions, or the "
                                "last request did not complete (its session is closed)", "type": "invalid_request_error",
                                "param": "type", "code": "no_session"}, 1008)
                    return
                share = _session_share(state.runtime, sid, *size) if size is not None else None
                if share is not None and share >= opts.session_kv_share:  # the pool keeps room for the others
                    _close_session(state.runtime, sid, *size)
                    sid = None
                    await fail({"message": f"this session holds {share:.0%} of the KV pool, its share is "
                                f"{opts.session_kv_share:.0%} (deploy server.session_kv_share): it is closed; start a new "
                                "stream (or deploy rollout_options.window for long videos)", "type": "invalid_request_error",
                                "param": "type", "code": "session_full"}, 1008)
                    return
                if requests >= MAX_REQUESTS:
                    await fail({"message": f"at most {MAX_REQUESTS} requests per connection; open a new stream",
                                "type": "invalid_request_error", "param": "type", "code": "too_many_requests"}, 1008)
                    return
                unknown = sorted(k for k in msg if k not in CONTINUE_FIELDS | {"type"})
                if unknown or not isinstance(msg.get("prompt"), str):
                    what = f"unknown field {unknown[0][:40]!r}" if unknown else "prompt: a string is required"
                    await fail({"message": f"continue: {what} (accepted: {', '.join(sorted(CONTINUE_FIELDS))})",
                                "type": "invalid_request_error", "param": unknown[0][:40] if unknown else "prompt",
                                "code": "invalid_request_error"}, 1008)
                    return
                body = {k: v for k, v in copy.deepcopy(start).items() if k not in ("frames", "seconds")}
                if not any(k in msg for k in ("frames", "seconds")):
                    for k in ("frames", "seconds"):
                        if k in start:
                            body[k] = start[k]
                body.update({k: v for k, v in msg.items() if k != "type"})
                omni = body.get("omniloop")
                if isinstance(omni, dict):
                    omni.pop("request_id", None)
                handle, bad = await build(body, {"session": sid, "keep_session": True})
        except WebSocketDisconnect:
            if handle is not None:
                engine.cancel(handle.request_id)
        finally:
            if recv is not None and not recv.done():
                recv.cancel()
            if handle is not None and not handle.done():
                engine.cancel(handle.request_id)
            if sid is not None and size is not None:
                _close_session(state.runtime, sid, *size)
            if slot:
                sessions.release(client)

    return [WebSocketRoute("/v1/videos/stream", endpoint)]
