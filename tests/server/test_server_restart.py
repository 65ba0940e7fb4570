"""Issue 43, finding 7: a restart on the same output folder after ``kill -9`` — earlier jobs are
listed again and a completed one's mp4 is served, the job that was running is listed as failed,
old ids are never given to a new job, and output files no job keeps are deleted (the retention
rule in ``omniloop_server.jobs``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

T = 60.0

SERVE = """
import sys
from omniloop.testing import make_manager
from omniloop_scheduler import plugin as scheduler_plugin
from omniloop_server.cli import make_serve_command

cmd = make_serve_command(make_manager(("scheduler", scheduler_plugin), scheduler=False))
cmd.main(sys.argv[1:], prog_name="omniloop serve")
"""


def _start(tmp_path: Path, checkpoint: Path, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(checkpoint)}, "scheduler": "step",
                                  "limits": {"max_steps": 1_000_000}}))
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    proc = subprocess.Popen(
        [sys.executable, str(script), "--deploy", str(deploy), "--port", "0", "--output-dir", str(out),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + T
    while True:  # the real port is printed once bound (--port 0)
        line = proc.stdout.readline().decode(errors="replace")
        assert line or proc.poll() is None, "server exited"
        if line.startswith("omniloop: serving"):
            url = line.split(" on ", 1)[1].split()[0]
            assert not url.endswith(":0"), line
            break
        assert time.monotonic() < deadline, "server did not start"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not answer"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_restart_after_kill_lists_serves_fails_and_never_reuses(server_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, url = _start(tmp_path, server_checkpoint, out)
    try:
        with httpx.Client(base_url=url, timeout=T) as c:
            assert c.post("/v1/videos", json={"prompt": "x", "steps": 2, "size": "16x16",
                                              "omniloop": {"request_id": "done-job"}}).status_code == 200
            while c.get("/v1/videos/done-job").json()["status"] != "completed":
                time.sleep(0.05)
            mp4 = c.get("/v1/videos/done-job/content").content
            assert c.post("/v1/videos", json={"prompt": "x", "steps": 2, "size": "16x16",
                                              "omniloop": {"request_id": "gone-job"}}).status_code == 200
            while c.get("/v1/videos/gone-job").json()["status"] != "completed":
                time.sleep(0.05)
            assert c.delete("/v1/videos/gone-job").status_code == 200
            assert c.post("/v1/videos", json={"prompt": "x", "steps": 1_000_000, "size": "16x16",
                                              "omniloop": {"request_id": "killed-job"}}).status_code == 200
            while c.get("/v1/videos/killed-job").json()["status"] != "in_progress":
                time.sleep(0.05)
    finally:
        _stop(proc, signal.SIGKILL)
    stale = out / ("ab" * 16 + ".mp4")  # an output no job knows (e.g. written as the server died)
    stale.write_bytes(b"x")

    proc, url = _start(tmp_path, server_checkpoint, out)
    try:
        with httpx.Client(base_url=url, timeout=T) as c:
            listed = {j["id"]: j for j in c.get("/v1/videos", params={"order": "asc"}).json()["data"]}
            assert set(listed) == {"done-job", "killed-job"}, listed
            assert listed["done-job"]["status"] == "completed"
            assert c.get("/v1/videos/done-job/content").content == mp4  # served from the same file
            killed = listed["killed-job"]
            assert killed["status"] == "failed" and killed["error"]["code"] == "server_restarted", killed
            assert c.get("/v1/videos/gone-job").status_code == 404
            for rid in ("done-job", "killed-job", "gone-job"):  # never reused, deleted ones included
                r = c.post("/v1/videos", json={"prompt": "x", "steps": 2, "size": "16x16", "omniloop": {"request_id": rid}})
                assert r.status_code == 422 and r.json()["error"]["param"] == "omniloop.request_id", r.text
            events = c.get("/v1/videos/killed-job/events").text  # a finished job's SSE ends with done
            assert "event: done" in events
    finally:
        _stop(proc, signal.SIGTERM)
    assert not stale.exists()
    names = {p.name for p in out.iterdir()}
    assert sum(n.endswith(".mp4") for n in names) == 1  # done-job's only
