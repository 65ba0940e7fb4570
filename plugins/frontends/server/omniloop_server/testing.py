"""Test helper: serve an app with uvicorn on a loopback socket (ephemeral port) in a thread."""

from __future__ import annotations

import contextlib
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
