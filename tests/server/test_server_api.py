"""The HTTP API against a real uvicorn server on loopback (toy family, CPU). Bounded waits only."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import httpx
import pytest

from omniloop_server.testing import video_events, wait_video

T = 60.0


def video_body(steps: int = 4, **kw: Any) -> dict[str, Any]:
    return {"prompt": "a red fox", "size": "16x16", "frames": 3, "steps": steps, "seed": 1, **kw}


def test_video_job_runs_to_completion_and_serves_an_mp4(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", json=video_body(fps=8))
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["progress"] >= 0
        done = wait_video(c, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100 and done["frames"] == 3
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.content[4:8] == b"ftyp"
        import av

        with av.open(io.BytesIO(content.content)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 3
        assert job["id"] in [j["id"] for j in c.get("/v1/videos").json()["data"]]


def test_content_is_409_until_completed_then_cancel_then_delete(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        job = c.post("/v1/videos", json=video_body(steps=300)).json()
        r = c.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"].startswith("video_")
        assert "available once it completed" in r.json()["error"]["message"]
        assert c.post(f"/v1/videos/{job['id']}/cancel").status_code == 200
        done = wait_video(c, job["id"])
        # OpenAI's Video has no "cancelled" status: a cancelled job is failed with error.code cancelled
        assert done["status"] == "failed" and done["error"]["code"] == "cancelled"
        assert "cancelled by the client" in done["error"]["message"]
        r = c.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and "was cancelled" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "video_cancelled"
        gone = c.delete(f"/v1/videos/{job['id']}")
        assert gone.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert c.get(f"/v1/videos/{job['id']}").status_code == 404
        assert c.get("/v1/videos/nope/content").status_code == 404


def test_sse_streams_progress_then_done(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        job = c.post("/v1/videos", json=video_body(steps=5)).json()
        events = video_events(c, job["id"])
    names = [n for n, _ in events]
    assert names[0] == "status" and names[-1] == "done"
    assert [d["step"] for n, d in events if n == "progress"] == [1, 2, 3, 4, 5]
    assert events[-1][1]["status"] == "completed"


MALFORMED = [
    ([1, 2], "body"),
    ({"size": "16x16"}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": "30x30"}, "size"),  # toy: multiple of 4
    ({"prompt": "x", "size": "128x128"}, "size"),  # above the deploy's max_width
    ({"prompt": "x", "steps": "5"}, "steps"),
    ({"prompt": "x", "steps": 10_000}, "steps"),  # deploy limit
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "seconds": -1}, "seconds"),
    ({"prompt": "x", "seconds": 1, "frames": 3}, "frames"),
    ({"prompt": "x", "foo": 1}, "foo"),
    ({"prompt": "x", "model": "other-model"}, "model"),
    ({"prompt": "x", "omniloop": {"diffusion": {"shift": -1.0}}}, "omniloop.diffusion.shift"),
    ({"prompt": "x", "omniloop": {"diffusion": {"bogus": 1}}}, "omniloop.diffusion.bogus"),
    ({"prompt": "x", "omniloop": {"plugin_params": {"probe": {}}}}, "omniloop.plugin_params.probe"),  # not enabled
    ({"prompt": "x", "omniloop": {"node_params": {"denoise": {"guidance_scale": -2.0}}}},
     "omniloop.node_params.denoise.guidance_scale"),
    ({"prompt": "x", "steps": 4, "omniloop": {"diffusion": {"steps": 5}}}, "omniloop.diffusion.steps"),
    ({"prompt": "x", "omniloop": "nope"}, "omniloop"),
    ({"prompt": "x", "priority": 1000}, "priority"),
]


@pytest.mark.parametrize(("body", "param"), MALFORMED)
def test_malformed_video_bodies_are_422_with_the_field_path(server: Any, body: Any, param: str) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    assert r.json()["detail"][0]["loc"][0] == "body"


def test_images_generation_returns_png_b64(server: Any) -> None:
    url, _ = server
    from PIL import Image

    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a cat", "n": 2, "size": "16x16", "steps": 3, "seed": 5})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == 2
        imgs = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in data]
        assert all(i.format == "PNG" and i.size == (16, 16) for i in imgs)
        bad = c.post("/v1/images/generations", json={"prompt": "a cat", "response_format": "gif"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "response_format"
        bad = c.post("/v1/images/generations", json={"prompt": "a cat", "n": 50})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "n"


def test_models_health_and_metrics(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        models = c.get("/v1/models").json()["data"]
        assert models[0]["family"] == "toy" and "t2v" in models[0]["tasks"]
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        m = c.get("/metrics")
        assert m.status_code == 200 and "# TYPE omniloop_step_seconds histogram" in m.text
        assert "omniloop_queue_depth 0" in m.text
