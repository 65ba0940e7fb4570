"""Test helpers: serve an app with uvicorn on a loopback socket (ephemeral port) in a thread; read a
video job's server-sent events."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serving(app: Any, timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on a loopback socket in a background thread; yield its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: without, every small response waits ~40 ms for a delayed
    # ACK (Nagle); uvicorn sets it on the sockets it binds itself, not on one handed to it
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    from .cli import connection_options

    state = getattr(app.state, "omniloop", None)
    limits = connection_options(state.options) if state is not None else {}  # the guards `omniloop serve` runs with
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-test")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def wait_video(client: Any, video_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll ``GET /v1/videos/{video_id}`` with ``client`` until the job is ``completed`` or
    ``failed``: its last state (``AssertionError`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/videos/{video_id}").json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} not terminal after {timeout}s")


def video_events(client: Any, video_id: str) -> list[tuple[str | None, Any]]:
    """``GET /v1/videos/{video_id}/events`` read with ``client`` (an ``httpx.Client``) up to and
    including the ``done`` event: ``(event name, parsed data)`` each."""
    events: list[tuple[str | None, Any]] = []
    with client.stream("GET", f"/v1/videos/{video_id}/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == "done":
                    break
    return events
