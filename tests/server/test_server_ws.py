"""Issue 21: ``WS /v1/videos/stream`` on a tiny causal Wan deployment, with a real WebSocket client
(``websockets``) against uvicorn on a loopback socket: chunks arrive before the end, their frames
equal the Python API's stream (torch.equal), continue keeps the session, bad start messages get
an error then a close, a disconnect mid-stream frees the KV slabs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.testing import make_manager

ROLLOUT = {"chunk_frames": 3, "steps": 2, "kv_slabs": 8, "max_sessions": 2}


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("wan-causal") / "t2v", variant="t2v", scheduler="flow_euler")


def _runtime(path: Path, scheduler: str | None = None) -> Runtime:
    from omniloop_scheduler import plugin as scheduler_plugin
    from omniloop_wan import plugin as wan_plugin

    opts = {"rollout": "causal", "rollout_options": ROLLOUT}
    if scheduler is None:
        return Runtime.from_model(path, manager=make_manager(("wan", wan_plugin), toy=False), options=opts)
    manager = make_manager(("wan", wan_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    return Runtime.from_model(path, manager=manager, options=opts, scheduler=scheduler)


@pytest.fixture(scope="module")
def reference(tiny_wan: Path) -> dict[str, list[torch.Tensor]]:
    """The Python API's chunks: one request of 21 frames (2 chunks), then a continue of 9 frames."""
    rt = _runtime(tiny_wan)
    req = {"task": "t2v", "prompt": "a red fox runs", "diffusion": {"frames": 21, "seed": 4},
           "outputs": {"stream_partial": True}, "node_params": {"rollout": {"keep_session": True}}}
    first, out = [], None
    for ev in rt.stream(req):
        if ev.kind is EventKind.PARTIAL:
            first.append(ev.value.frames)
        if ev.kind is EventKind.FINAL:
            out = ev.output
    sid = out.metrics["session"]
    req2 = {"task": "t2v", "prompt": "a blue bird flies", "diffusion": {"frames": 9, "seed": 4},
            "outputs": {"stream_partial": True}, "node_params": {"rollout": {"session": sid}}}
    second = [ev.value.frames for ev in rt.stream(req2) if ev.kind is EventKind.PARTIAL]
    return {"first": first, "second": second}


@pytest.fixture(scope="module")
def served(tiny_wan: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = _runtime(tiny_wan, scheduler="step")
    # one client address opens the tests' sockets one after another: a slot per test is plenty, but
    # a closed socket's slot comes back as the server notices, so allow a few; and let a session use
    # the whole (8-slab) pool as these tests continue sessions (the caps: `capped` below)
    app = create_app(rt, output_dir=tmp_path_factory.mktemp("out"), shutdown_timeout=0,
                     server_options={"max_sessions": 4, "max_sessions_per_client": 4, "session_kv_share": 1.0})
    with serving(app) as url:
        yield url.replace("http://", "ws://") + "/v1/videos/stream", rt


def _pool(rt: Runtime):
    from omniloop_wan.causal.pipeline import CausalDeployment

    dep = rt.model.config["causal"]
    assert isinstance(dep, CausalDeployment)
    return dep.engine(32, 32)


def _run(ws: Any) -> tuple[list[tuple[float, torch.Tensor]], dict[str, Any], list[dict[str, Any]]]:
    """Read one request's messages up to its done: (arrival time, frames) per chunk, done, the rest."""
    chunks, other = [], []
    while True:
        msg = json.loads(ws.recv(timeout=120))
        if msg["type"] == "chunk":
            data = ws.recv(timeout=120)
            assert isinstance(data, bytes) and len(data) == msg["frames"] * msg["height"] * msg["width"] * 3
            frames = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(msg["frames"], msg["height"], msg["width"], 3)
            chunks.append((time.monotonic(), frames))
        elif msg["type"] == "done":
            return chunks, msg, other
        else:
            other.append(msg)


def test_chunks_stream_equal_the_python_api_and_continue_keeps_the_session(served, reference) -> None:
    url, rt = served
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"type": "start", "prompt": "a red fox runs", "frames": 21, "seed": 4}))
        chunks, done, other = _run(ws)
        done_at = time.monotonic()
        eng, store = _pool(rt)  # made by the first request
        assert other[0]["type"] == "accepted" and any(m["type"] == "progress" for m in other)
        assert done["status"] == "completed" and done["frames"] == 21 and done["session"].startswith("sess-")
        assert [c.shape[0] for _, c in chunks] == [9, 12]
        assert chunks[0][0] < done_at  # the first chunk came before the end
        for (_, got), want in zip(chunks, reference["first"], strict=True):
            assert torch.equal(got, want)
        assert len(store) == 1 and eng.manager.used_blocks == 2  # the session is kept for a continue

        ws.send(json.dumps({"type": "continue", "prompt": "a blue bird flies", "frames": 9}))
        chunks2, done2, _ = _run(ws)
        assert done2["status"] == "completed" and done2["session"] == done["session"]
        assert len(chunks2) == 1 and torch.equal(chunks2[0][1], reference["second"][0])
        assert store.get(done["session"]).chunks == 3
        ws.send(json.dumps({"type": "close"}))
    deadline = time.monotonic() + 10
    while len(store) and time.monotonic() < deadline:  # the server frees the session as the socket closes
        time.sleep(0.05)
    assert len(store) == 0 and eng.manager.used_blocks == 0
    eng.manager.check()


def _start_three_chunks(ws: Any, seed: int) -> None:
    """Start a 3-chunk request ("a red fox runs", 33 frames, ``seed``); return at its first chunk's header."""
    ws.send(json.dumps({"prompt": "a red fox runs", "frames": 33, "seed": seed}))
    while json.loads(ws.recv(timeout=120))["type"] != "chunk":
        pass


def test_disconnect_mid_stream_cancels_and_frees_the_slabs(served) -> None:
    url, rt = served
    with connect(url, max_size=None) as ws:
        _start_three_chunks(ws, seed=1)
        eng, store = _pool(rt)
        ws.close()  # gone after the first chunk
    deadline = time.monotonic() + 30
    while (eng.manager.used_blocks or eng.manager.reserved_blocks or len(store)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0 and len(store) == 0
    eng.manager.check()


@pytest.mark.parametrize(("message", "param"), [
    ("not json", "body"),
    ('["a list"]', "body"),
    ('{"type": "continue", "prompt": "x"}', "type"),
    ('{"prompt": "a fox", "steps": "many"}', "steps"),
    ('{"prompt": "a fox", "frames": 9, "seed": NaN}', "body"),
    ('{"prompt": "a fox", "frames": 9, "omniloop": {"node_params": {"rollout": {"session": "../x"}}}}',
     "omniloop.node_params.rollout"),
    ('{"prompt": "a fox", "model": "gpt-4"}', "model"),
])
def test_a_bad_start_message_gets_an_error_then_a_close(served, message: str, param: str) -> None:
    url, _ = served
    with connect(url, max_size=None) as ws:
        ws.send(message)
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error", msg
        assert msg["error"]["param"] == param, msg
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1008


def test_continue_without_a_session_and_unknown_fields_are_refused(served) -> None:
    url, _ = served
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a fox", "frames": 9, "seed": 2}))
        _, done, _ = _run(ws)
        assert done["status"] == "completed"
        ws.send(json.dumps({"type": "continue", "prompt": "a cat", "size": "64x64"}))
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error" and msg["error"]["param"] == "size"


def test_a_request_the_pipeline_refuses_ends_with_a_failed_done_naming_the_field(served) -> None:
    url, _ = served
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a fox", "frames": 13}))  # not whole chunks: refused at the rollout node
        chunks, done, _ = _run(ws)
        assert not chunks and done["status"] == "failed" and "diffusion.frames" in done["error"]["message"]


def test_a_message_while_running_is_busy_cancel_stops_and_closes_the_session(served) -> None:
    url, rt = served
    with connect(url, max_size=None) as ws:
        _start_three_chunks(ws, seed=5)
        ws.send(json.dumps({"type": "continue", "prompt": "too early"}))
        ws.send(json.dumps({"type": "cancel"}))
        busy = done = None
        while done is None:
            got = ws.recv(timeout=120)
            if isinstance(got, bytes):
                continue
            msg = json.loads(got)
            if msg["type"] == "error":
                busy = msg
            elif msg["type"] == "done":
                done = msg
        assert busy is not None and busy["error"]["code"] == "busy"  # the socket stayed open
        assert done["status"] == "cancelled" and done["session"] is None
        ws.send(json.dumps({"type": "continue", "prompt": "a cat"}))
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error" and msg["error"]["code"] == "no_session"
    eng, store = _pool(rt)
    deadline = time.monotonic() + 30
    while (eng.manager.used_blocks or eng.manager.reserved_blocks or len(store)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0 and len(store) == 0


def test_an_idle_socket_is_closed_when_the_server_drains(server_checkpoint: Path, tmp_path: Path) -> None:
    """Toy family (not streaming): the whole clip comes as one chunk; then the drain closes the
    socket idle between requests with a shutting_down error and 1001."""
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_runtime(server_checkpoint, scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0)
    with serving(app) as url, connect(url.replace("http://", "ws://") + "/v1/videos/stream", max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a fox", "steps": 2, "size": "16x16", "seed": 1}))
        chunks, done, _ = _run(ws)
        assert done["status"] == "completed" and len(chunks) == 1 and done["session"] is None
        state = app.state.omniloop
        state.loop.call_soon_threadsafe(state.begin_drain)
        msg = json.loads(ws.recv(timeout=30))
        assert msg["type"] == "error" and msg["error"]["code"] == "shutting_down"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1001


# -- issue 43: bounded sessions; issue 42 (finding 2): causal from the resolved deployment ---------------


def test_a_refused_continuation_releases_its_session(served) -> None:
    """The rollout check refuses a continue (more chunks than the pool's slabs): the session it named
    is closed at once (the done says none is left) — before, the socket forgot its id and its slabs
    stayed held until the session TTL."""
    url, rt = served
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a red fox runs", "frames": 21, "seed": 4}))  # 2 chunks, kept
        _, done, _ = _run(ws)
        assert done["status"] == "completed" and done["session"]
        eng, store = _pool(rt)
        assert len(store) == 1
        ws.send(json.dumps({"type": "continue", "prompt": "a cat", "frames": 81}))  # 2 + 7 chunks > 8 slabs
        chunks, done2, _ = _run(ws)
        assert not chunks and done2["status"] == "failed" and "slabs" in done2["error"]["message"]
        assert done2["session"] is None
        assert len(store) == 0 and eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0
        ws.send(json.dumps({"type": "continue", "prompt": "a cat", "frames": 9}))
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error" and msg["error"]["code"] == "no_session"
    eng.manager.check()


@pytest.mark.parametrize("rollout", [{"keep_session": True}, {"session": "sess-" + "0" * 24}])
def test_post_videos_neither_keeps_nor_continues_a_session(served, rollout) -> None:
    """Only the endpoint that returns a session id makes one; a POST naming one is refused (before,
    it created orphan sessions nobody learnt the id of, or continued another client's)."""
    import httpx

    url, rt = served
    http = url.replace("ws://", "http://").removesuffix("/v1/videos/stream")
    r = httpx.post(http + "/v1/videos", timeout=60,
                   json={"prompt": "a fox", "frames": 9, "omniloop": {"node_params": {"rollout": rollout}}})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == f"omniloop.node_params.rollout.{next(iter(rollout))}"
    from omniloop_wan.causal.pipeline import CausalDeployment

    dep = rt.model.config.get("causal")
    assert not isinstance(dep, CausalDeployment) or all(len(s) == 0 for _, s in dep._engines.values())


@pytest.fixture
def capped(tiny_wan: Path, tmp_path: Path) -> Iterator[tuple[str, Any, Any]]:
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = _runtime(tiny_wan, scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0,
                     server_options={"max_sessions": 2, "max_sessions_per_client": 1, "ws_start_timeout_s": 0.5,
                                     "ws_idle_timeout_s": 1.0})
    with serving(app) as url:
        yield url, rt, app


def test_sessions_are_capped_per_client_with_a_retry_hint_and_health_shows_them(capped) -> None:
    import httpx

    url, rt, _app = capped
    ws_url = url.replace("http://", "ws://") + "/v1/videos/stream"
    with connect(ws_url, max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a red fox runs", "frames": 9, "seed": 4}))
        _, done, _ = _run(ws)
        assert done["session"]
        health = httpx.get(url + "/health", timeout=60).json()
        assert health["sessions"] == {"open": 1, "max": 2, "per_client": 1}
        assert "kv" in health and health["kv"]["free_blocks"] < health["kv"]["num_blocks"]
        metrics = httpx.get(url + "/metrics", timeout=60).text
        assert 'omniloop_stream_sessions{kind="open"} 1' in metrics and "omniloop_causal_kv_blocks" in metrics
        with connect(ws_url, max_size=None) as ws2:  # the same client: its one session is in use
            ws2.send(json.dumps({"prompt": "a cat", "frames": 9}))
            msg = json.loads(ws2.recv(timeout=60))
            assert msg["type"] == "error" and msg["error"]["code"] == "sessions_full"
            assert msg["error"]["retry_after_s"] >= 1
            with pytest.raises(ConnectionClosed):
                ws2.recv(timeout=30)
            assert ws2.close_code == 1013
        # idle between requests past ws_idle_timeout_s: closed, and the session freed
        msg = json.loads(ws.recv(timeout=30))
        assert msg["type"] == "error" and msg["error"]["code"] == "idle_timeout"
    eng, store = _pool(rt)
    deadline = time.monotonic() + 10
    while (len(store) or httpx.get(url + "/health", timeout=60).json()["sessions"]["open"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(store) == 0 and eng.manager.used_blocks == 0


def test_a_websocket_that_never_starts_is_closed(capped) -> None:
    url, _, _ = capped
    with connect(url.replace("http://", "ws://") + "/v1/videos/stream", max_size=None) as ws:
        msg = json.loads(ws.recv(timeout=30))  # we send nothing
        assert msg["type"] == "error" and msg["error"]["code"] == "start_timeout"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1008


def test_continue_works_when_the_preset_not_the_deploy_makes_it_causal(tiny_wan: Path, tmp_path: Path) -> None:
    """Issue 42, finding 2: ``preset: wan-demo-causal`` says ``rollout: causal`` in the preset, not in
    the deploy's ``options``; the stream endpoint reads the deployment as loaded."""
    from omniloop.family import ModelPreset
    from omniloop.hookspecs import hookimpl
    from omniloop_scheduler import plugin as scheduler_plugin
    from omniloop_server import create_app
    from omniloop_server.testing import serving
    from omniloop_wan import plugin as wan_plugin

    class Presets:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_model_presets(self, register: Any) -> None:
            register(ModelPreset(name="tiny-causal", family="wan", path=lambda: tiny_wan,
                                 options={"rollout": "causal", "rollout_options": ROLLOUT}))

    manager = make_manager(("wan", wan_plugin), ("scheduler", scheduler_plugin), ("presets", Presets()),
                           toy=False, scheduler=False)
    rt = Runtime.from_deploy({"model": {"preset": "tiny-causal"}, "scheduler": "step"}, manager=manager)
    assert "rollout" not in rt.deploy.options
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0)
    with serving(app) as url, connect(url.replace("http://", "ws://") + "/v1/videos/stream", max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a red fox runs", "frames": 9, "seed": 4}))
        _, done, _ = _run(ws)
        assert done["status"] == "completed" and done["session"], done
        ws.send(json.dumps({"type": "continue", "prompt": "a blue bird flies", "frames": 9}))
        _, done2, _ = _run(ws)
        assert done2["status"] == "completed" and done2["session"] == done["session"]


def test_a_session_cannot_grow_past_its_share_of_the_pool(capped) -> None:
    """A kept session may hold at most ``server.session_kv_share`` of the KV pool (default 0.25: 2
    of these 8 slabs): a continue beyond it is refused and the session closed, so sessions never
    take the room one-off streams need."""
    url, rt, _ = capped
    with connect(url.replace("http://", "ws://") + "/v1/videos/stream", max_size=None) as ws:
        ws.send(json.dumps({"prompt": "a red fox runs", "frames": 21, "seed": 4}))  # 2 chunks: 2 slabs
        _, done, _ = _run(ws)
        assert done["status"] == "completed" and done["session"]
        ws.send(json.dumps({"type": "continue", "prompt": "more", "frames": 9}))
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error" and msg["error"]["code"] == "session_full", msg
    eng, store = _pool(rt)
    assert len(store) == 0 and eng.manager.used_blocks == 0


def test_a_full_kv_pool_answers_429_with_retry_after_instead_of_queueing(tiny_wan: Path, tmp_path: Path) -> None:
    """Issue 43, finding 4: while kept sessions (here: a reservation made in-process) hold the causal
    KV pool, a one-off POST /v1/videos and a WebSocket start were queued silently until blocks came
    back (minutes, with sessions); now they are refused at once — 429 with ``Retry-After`` /
    an ``error`` with ``retry_after_s`` — and nothing is queued. ``kv_full: queue`` keeps queueing."""
    import httpx

    from omniloop_server import create_app
    from omniloop_server.testing import serving

    def finished(url: str, r: Any) -> str:
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = httpx.get(f"{url}/v1/videos/{r.json()['id']}", timeout=60).json()
            if job["status"] in ("completed", "failed", "cancelled"):
                return job["status"]
            time.sleep(0.05)
        return "timeout"

    body = {"prompt": "a red fox runs", "frames": 9, "seed": 4, "size": "32x32"}
    for kv_full in ("refuse", "queue"):
        rt = _runtime(tiny_wan, scheduler="step")
        app = create_app(rt, output_dir=tmp_path / kv_full, shutdown_timeout=0,
                         server_options={"retry_after_s": 7, "kv_full": kv_full})
        with serving(app) as url:
            assert finished(url, httpx.post(url + "/v1/videos", json=body, timeout=60)) == "completed"  # the pool exists
            mgr = _pool(rt)[0].manager
            hog = mgr.allocate(0, reserve_tokens=mgr.free_blocks * mgr.block_size, tag="hog")
            submitted = app.state.omniloop.engine.stats()["submitted"]
            try:
                assert mgr.free_blocks == 0
                r = httpx.post(url + "/v1/videos", json=body, timeout=60)
                if kv_full == "queue":  # waits for blocks (the old behaviour, now an opt-in)
                    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
                    continue
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "7" and r.json()["error"]["code"] == "kv_cache_full"
                assert "0 of 8 are free" in r.json()["error"]["message"]
                with connect(url.replace("http://", "ws://") + "/v1/videos/stream", max_size=None) as ws:
                    ws.send(json.dumps(body))
                    msg = json.loads(ws.recv(timeout=60))
                    assert msg["type"] == "error" and msg["error"]["code"] == "kv_cache_full", msg
                    assert msg["error"]["retry_after_s"] == 7
                assert app.state.omniloop.engine.stats()["submitted"] == submitted  # nothing was queued
            finally:
                mgr.free(hog)
            assert finished(url, httpx.post(url + "/v1/videos", json=body, timeout=60)) == "completed"
