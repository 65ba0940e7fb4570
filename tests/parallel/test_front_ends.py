"""Front ends on multi-process deploys: ``omniloop generate --deploy`` loads through
``Runtime.from_deploy`` (the one factory: it hands the deploy to omniloop-parallel's runtime loader), so a ``placement`` deploy
runs on role workers and a ``parallel`` deploy on the SPMD pool; ``omniloop serve`` serves
``placement`` and refuses ``parallel`` with one line before any weight loads.

The CLI passes a PluginManager object; the workers then discover the installed entry points.
Latents are compared (the mp4 is lossy): ``torch.equal`` to one process with one thread.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from omniloop.runtime import Runtime
from omniloop.testing import torch_threads
from omniloop_cli import cli
from omniloop_parallel.testing import wan_manager

from .conftest import wan_request

ARGS = ["a red fox in the snow", "--negative-prompt", "blurry", "--steps", "3", "--seed", "3", "--frames", "9",
        "--height", "32", "--width", "32", "--guidance-scale", "5.0", "--return-latents", "--json"]


@pytest.fixture(scope="module")
def one_thread():
    with torch_threads(1):  # the workers' thread count: CPU BLAS sums depend on it
        yield


@pytest.fixture(scope="module")
def reference(wan_ckpt, one_thread):
    out = Runtime.from_model(wan_ckpt, manager=wan_manager()).generate(wan_request())
    assert out.ok, out.error
    return out


def _generate(tmp_path: Path, deploy: dict) -> dict:
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps(deploy))
    out = tmp_path / "fox.mp4"
    res = CliRunner().invoke(cli, ["generate", *ARGS, "--deploy", str(path), "--out", str(out)], obj=wan_manager())
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("layout", [{"placement": {"vae": {"devices": ["cpu"]}}}, {"parallel": {"cfg": 2}}],
                         ids=["placement", "parallel-cfg2"])
def test_generate_deploy_runs_on_the_workers(wan_ckpt, reference, tmp_path, layout):
    doc = _generate(tmp_path, {"model": {"path": str(wan_ckpt)}, **layout})
    assert doc["status"] == "completed"
    latents = torch.load(doc["files"]["latents"])
    assert torch.equal(latents, reference.artifacts["latents"].tensor)
    if "placement" in layout:  # the decode ran in the role worker
        assert doc["metrics"]["roles"]["vae_decode"]["device"] == "cpu"
    else:  # every rank reported
        assert [r["rank"] for r in doc["metrics"]["ranks"]] == [0, 1]


def test_serve_refuses_a_parallel_deploy_before_loading(wan_ckpt, tmp_path, monkeypatch):
    from omniloop_server.cli import make_serve_command
    from omniloop_wan.family import WanFamily

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(WanFamily, "load", no_load)
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"model": {"path": str(wan_ckpt)}, "parallel": {"cfg": 2}}))
    res = CliRunner().invoke(make_serve_command(wan_manager()), ["--deploy", str(path)])
    assert res.exit_code != 0
    assert "parallel: omniloop serve cannot serve a parallel deploy (sp 1, cfg 2) yet" in res.output


def test_serve_runs_a_placement_deploy_on_the_role_worker(wan_ckpt, tmp_path, one_thread):
    import httpx

    from omniloop_server import create_app
    from omniloop_server.testing import serving

    from .conftest import MANAGER

    rt = Runtime.from_deploy({"model": {"path": str(wan_ckpt)}, "placement": {"vae": {"devices": ["cpu"]}}},
                             manager=MANAGER)
    try:
        app = create_app(rt, output_dir=tmp_path / "out", scheduler="step", shutdown_timeout=0, poll_after_ms=50)
        with serving(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            job = c.post("/v1/videos", json={"prompt": "a red fox", "size": "32x32", "frames": 9, "steps": 2,
                                              "seed": 1}).json()
            deadline = time.monotonic() + 120
            while (done := c.get(f"/v1/videos/{job['id']}").json())["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert done["status"] == "completed", done
            assert c.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"
        trace = app.state.omniloop.engine.pool.trace
        assert [d.node for d in trace if d.action == "dispatch"] == ["vae_decode"]
    finally:
        rt.close()
