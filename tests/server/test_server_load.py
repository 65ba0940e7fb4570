"""Load and fault tests against a real server on loopback: concurrent clients, cancellations
mid-run, malformed bodies, an injected failing step, a full queue. The server stays up, every
accepted job ends terminal, and /metrics adds up."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniloop_scheduler.testing import make_runtime
from omniloop_server.testing import serving

T = 90.0


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value.replace("+Inf", "inf"))
    return out


@pytest.mark.slow
def test_concurrent_clients_cancellations_failures_and_malformed_bodies(probe_server: Any) -> None:
    url, probe, _app = probe_server
    probe.fail_at["vid_fail"] = 2
    n_clients, jobs_per_client = 6, 3

    async def client(i: int, c: httpx.AsyncClient) -> list[tuple[str, str]]:
        """Each client submits jobs; some it cancels mid-run; one is the injected failure."""
        accepted: list[tuple[str, str]] = []
        for j in range(jobs_per_client):
            body: dict[str, Any] = {"prompt": f"client {i} job {j}", "size": "16x16", "frames": 3, "seed": i * 10 + j}
            intent = "complete"
            if i == 0 and j == 0:
                body["omniloop"] = {"request_id": "vid_fail"}
                body["steps"] = 6
                intent = "fail"
            elif j == 1 and i % 2 == 0:
                body["steps"] = 250
                intent = "cancel"
            else:
                body["steps"] = 4 + j
            r = await c.post("/v1/videos", json=body)
            assert r.status_code == 200, r.text
            accepted.append((r.json()["id"], intent))
            bad = await c.post("/v1/videos", json={"prompt": "x", "steps": "many"})  # malformed in between
            assert bad.status_code == 422 and bad.json()["error"]["param"] == "steps"
        for job_id, intent in accepted:
            if intent == "cancel":
                deadline = time.monotonic() + T
                while (await c.get(f"/v1/videos/{job_id}")).json()["progress"] < 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # cancel mid-run, once it has made progress
                assert (await c.post(f"/v1/videos/{job_id}/cancel")).status_code == 200
        return accepted

    async def main() -> tuple[list[tuple[str, str]], dict[str, dict[str, Any]], str, int]:
        async with httpx.AsyncClient(base_url=url, timeout=T) as c:
            results = await asyncio.gather(*(client(i, c) for i in range(n_clients)))
            accepted = [a for r in results for a in r]
            final: dict[str, dict[str, Any]] = {}
            deadline = time.monotonic() + T
            while len(final) < len(accepted) and time.monotonic() < deadline:
                for job_id, _ in accepted:
                    if job_id not in final:
                        job = (await c.get(f"/v1/videos/{job_id}")).json()
                        if job["status"] in ("completed", "failed"):
                            final[job_id] = job
                await asyncio.sleep(0.05)
            metrics = (await c.get("/metrics")).text
            health = (await c.get("/health")).status_code
            return accepted, final, metrics, health

    accepted, final, metrics_text, health = asyncio.run(asyncio.wait_for(main(), 3 * T))
    assert len(final) == len(accepted) == n_clients * jobs_per_client  # every accepted job is terminal
    assert health == 200
    for job_id, intent in accepted:
        expected = {"complete": "completed", "fail": "failed", "cancel": "failed"}[intent]
        assert final[job_id]["status"] == expected, final[job_id]
        assert (intent == "cancel") == ((final[job_id]["error"] or {}).get("code") == "cancelled"), final[job_id]
    assert "injected failure" in final["vid_fail"]["error"]["message"]
    assert final["vid_fail"]["error"]["step"] == 2
    # interceptor state of cancelled and failed requests was released
    assert sorted(probe.opened) == sorted(probe.closed)

    m = parse_metrics(metrics_text)
    finished = {s: m[f'omniloop_requests_finished_total{{status="{s}"}}'] for s in ("completed", "failed", "cancelled")}
    assert m["omniloop_requests_submitted_total"] == len(accepted)
    assert m["omniloop_queue_depth"] == 0 and m["omniloop_running"] == 0
    assert sum(finished.values()) == m["omniloop_requests_submitted_total"]
    assert finished == {
        "completed": sum(1 for _, i in accepted if i == "complete"),
        "failed": 1,
        "cancelled": sum(1 for _, i in accepted if i == "cancel"),
    }
    assert m["omniloop_request_failures_total"] == 1
    assert m['omniloop_requests_rejected_total{reason="invalid"}'] == len(accepted)
    assert m['omniloop_http_errors_total{code="422"}'] == len(accepted)
    assert m["omniloop_request_seconds_count"] == len(accepted)
    assert m['omniloop_request_seconds_bucket{le="+Inf"}'] == len(accepted)
    assert m["omniloop_outputs_written_total"] == finished["completed"]
    assert m["omniloop_request_steps_total"] >= m["omniloop_step_forwards_total"] > 0


def test_queue_full_is_429_and_server_recovers(server_checkpoint: Path, tmp_path: Path) -> None:
    from omniloop_server import create_app

    rt = make_runtime(server_checkpoint, scheduler="step", limits={"max_queue": 1},
                      scheduler_options={"max_running": 1})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url, httpx.Client(base_url=url, timeout=T) as c:
        body = {"prompt": "x", "size": "64x64", "frames": 9, "steps": 200}  # long enough to still run at DELETE
        first = c.post("/v1/videos", json=body).json()
        deadline = time.monotonic() + T
        while c.get(f"/v1/videos/{first['id']}").json()["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        second = c.post("/v1/videos", json=body)
        assert second.status_code == 200  # waits in the queue (max_running 1)
        third = c.post("/v1/videos", json=body)
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        # /cancel cancels a job still queued or running; a job that finished first (a fast machine
        # can run the tiny model's 200 steps before the cancel lands) just stays completed
        ids = [first["id"], second.json()["id"]]
        for jid in ids:
            assert c.post(f"/v1/videos/{jid}/cancel").status_code == 200
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            jobs = [c.get(f"/v1/videos/{jid}").json() for jid in ids]
            outcomes = {"cancelled" if (j["error"] or {}).get("code") == "cancelled" else j["status"] for j in jobs}
            if outcomes <= {"cancelled", "completed"}:
                break
            time.sleep(0.05)
        # a cancel can only lose a race with the job's own last step, never leave it hanging
        assert outcomes <= {"cancelled", "completed"} and "cancelled" in outcomes, outcomes
        ok = c.post("/v1/videos", json={**body, "size": "16x16", "frames": 3, "steps": 2})
        assert ok.status_code == 200
        m = c.get("/metrics").text
        assert re.search(r'omniloop_requests_rejected_total\{reason="queue_full"\} 1\b', m)
        assert re.search(r'omniloop_http_errors_total\{code="429"\} 1\b', m)


def test_serve_command_builds_the_app_from_a_deploy_file(server_checkpoint: Path, tmp_path: Path, monkeypatch: Any) -> None:
    import json

    from click.testing import CliRunner

    from omniloop.testing import make_manager
    from omniloop_scheduler import plugin as scheduler_plugin
    from omniloop_server import cli

    calls: list[tuple[Any, str, int]] = []
    monkeypatch.setattr(cli, "run_server", lambda app, host, port, log_level, timeout: calls.append((app, host, port)))
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(server_checkpoint)}, "scheduler": "step",
                                  "scheduler_options": {"max_batch": 4}}))
    cmd = cli.make_serve_command(make_manager(("scheduler", scheduler_plugin), scheduler=False))
    res = CliRunner().invoke(cmd, ["--deploy", str(deploy), "--port", "0", "--output-dir", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    (app, host, port), = calls
    assert (host, port) == ("127.0.0.1", 0)
    assert app.state.omniloop.engine.scheduler == "step" and app.state.omniloop.engine.options.max_batch == 4
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/v1/videos", "/v1/videos/{video_id}/content", "/v1/images/generations", "/metrics", "/health"} <= paths

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"path": str(tmp_path / "missing")}}))
    res = CliRunner().invoke(cmd, ["--deploy", str(bad)])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output


def test_plugin_registers_the_serve_command() -> None:
    import click

    from omniloop_server import plugin

    @click.group()
    def cli() -> None: ...

    plugin.omniloop_register_commands(cli=cli)
    assert "serve" in cli.commands
