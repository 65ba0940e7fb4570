"""Issue 42, finding 1, over HTTP: ``images.generate(size="1024x1024")`` on a model trained at a
small size ran for over 10 minutes, the SDK timed out and retried twice, and three jobs ran. A
checkpoint's declared range (``omniloop.json`` ``limits``) is checked before the request is queued:
the answer comes at once, names the field and the range, and no job is made (so a retry makes none
either)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from omniloop_scheduler.testing import make_runtime
from omniloop_server import create_app
from omniloop_server.testing import serving

T = 60.0


def test_a_size_outside_the_declared_range_is_refused_before_any_job(server_checkpoint: Path, tmp_path: Path) -> None:
    ck = tmp_path / "small"
    shutil.copytree(server_checkpoint, ck)
    (ck / "omniloop.json").write_text(json.dumps({"limits": {"min_height": 16, "max_height": 16, "min_width": 16,
                                                             "max_width": 16, "note": "trained at 16x16"}}))
    rt = make_runtime(ck, scheduler="step", limits={"max_steps": 300, "max_height": 2048, "max_width": 2048})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url, httpx.Client(base_url=url, timeout=T) as client:
        for _ in range(3):  # the SDK's two retries: each answered the same way, none makes a job
            r = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "1024x1024", "steps": 2})
            assert 400 <= r.status_code < 500, r.text
            msg = r.json()["error"]["message"]
            assert "outside what model" in msg and "16..16" in msg and "trained at 16x16" in msg, msg
        ok = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "16x16", "steps": 2})
        assert ok.status_code == 200, ok.text
    assert app.state.omniloop.engine.stats()["submitted"] == 1
