"""Shutdown: SIGTERM of a real ``omniloop serve`` process, and draining through the app.

Documented behaviour (README, ``omniloop serve --help``): stop admitting (503), let in-flight
jobs finish for ``--shutdown-timeout`` seconds, cancel the rest, append every job's final state
to ``<output dir>/jobs.jsonl``; SSE clients do not hold the shutdown up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from omniloop.testing import PassThroughSteps, component_plugin

T = 60.0

SERVE = """
import sys
from omniloop.testing import make_manager
from omniloop_scheduler import plugin as scheduler_plugin
from omniloop_server.cli import make_serve_command

cmd = make_serve_command(make_manager(("scheduler", scheduler_plugin), scheduler=False))
cmd.main(sys.argv[1:], prog_name="omniloop serve")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def records(out: Path) -> dict[str, dict[str, Any]]:
    lines = (out / "jobs.jsonl").read_text().splitlines() if (out / "jobs.jsonl").exists() else []
    return {r["id"]: r for r in map(json.loads, lines)}


def test_sigterm_cancels_running_jobs_within_the_timeout_and_records_them(server_checkpoint: Path, tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(server_checkpoint)}, "scheduler": "step",
                                  "limits": {"max_steps": 1_000_000}}))
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    out, port = tmp_path / "out", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), "--deploy", str(deploy), "--port", str(port), "--output-dir", str(out),
         "--shutdown-timeout", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + T
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=T) as c:
            short = c.post("/v1/videos", json={"prompt": "x", "steps": 2, "size": "16x16", "omniloop": {"request_id": "short"}})
            assert short.status_code == 200
            while c.get("/v1/videos/short").json()["status"] != "completed":
                time.sleep(0.05)
            long = c.post("/v1/videos", json={"prompt": "x", "steps": 1_000_000, "size": "16x16",
                                              "omniloop": {"request_id": "long"}})
            assert long.status_code == 200
            while c.get("/v1/videos/long").json()["progress"] < 1 and c.get("/v1/videos/long").json()["status"] != "in_progress":
                time.sleep(0.05)
        seen: list[str] = []

        def sse() -> None:  # an SSE client attached to the long job must not hold shutdown up
            with httpx.Client(base_url=url, timeout=T) as c, c.stream("GET", "/v1/videos/long/events") as r:
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        seen.append(line[7:])

        reader = threading.Thread(target=sse, daemon=True)
        reader.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    assert rc in (0, -signal.SIGTERM), log
    assert took < 15, f"shutdown took {took:.1f} s with --shutdown-timeout 1"
    rec = records(out)
    assert rec["short"]["status"] == "completed" and rec["short"]["file"].endswith(".mp4")
    assert rec["long"]["status"] == "cancelled", rec["long"]
    assert "shut down" in rec["long"]["error"]["message"]
    assert "done" in seen, (seen, log)
    assert "Traceback" not in log, log


def test_draining_refuses_new_jobs_and_records_cancelled_ones(server_checkpoint: Path, tmp_path: Path) -> None:
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_runtime(server_checkpoint, scheduler="step", limits={"max_steps": 1_000_000})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0.2)
    state = app.state.omniloop
    with serving(app) as url, httpx.Client(base_url=url, timeout=T) as c:
        job = c.post("/v1/videos", json={"prompt": "x", "steps": 1_000_000, "size": "16x16"}).json()
        assert state.loop is not None
        state.loop.call_soon_threadsafe(state.begin_drain)
        deadline = time.monotonic() + T
        while not state.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.post("/v1/videos", json={"prompt": "x", "steps": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert c.get("/health").status_code == 503
        while c.get(f"/v1/videos/{job['id']}").json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        done = c.get(f"/v1/videos/{job['id']}").json()
        assert done["error"]["code"] == "cancelled" and "shut down" in done["error"]["message"]
    assert records(tmp_path / "out")[job["id"]]["status"] == "cancelled"


class StuckStep(PassThroughSteps):
    """A step interceptor whose chosen request's step blocks until released (a very long step)."""

    name = "stuck"

    def __init__(self) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, step: Any, state: Any, inputs: Any, compute: Any) -> Any:
        if step.request_id == "stuck" and step.step_index == 1:
            self.entered.set()
            self.release.wait(60)
        return compute()


def test_shutdown_is_bounded_when_a_step_does_not_end(server_checkpoint: Path, tmp_path: Path, monkeypatch: Any) -> None:
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import app as app_mod
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    stuck = StuckStep()
    monkeypatch.setattr(app_mod, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(app_mod, "WRITE_GRACE_S", 0.5)
    plugin = component_plugin("stuck", "step_interceptor", lambda: stuck)
    rt = make_runtime(server_checkpoint, ("stuck", plugin), plugins={"stuck": {}}, scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0.2)
    try:
        with serving(app) as url, httpx.Client(base_url=url, timeout=T) as c:
            r = c.post("/v1/videos", json={"prompt": "x", "steps": 4, "size": "16x16", "omniloop": {"request_id": "stuck"}})
            assert r.status_code == 200, r.text
            assert stuck.entered.wait(T)
            t0 = time.monotonic()
        took = time.monotonic() - t0
    finally:
        stuck.release.set()
    assert took < 8, f"shutdown took {took:.1f} s with a step that never ends"
    rec = records(tmp_path / "out")["stuck"]
    assert rec["status"] == "cancelled" and "did not end in time" in rec["error"]["message"], rec
