"""Regression tests of issue 14 (server half): each body that used to write outside the output
folder, get a 500 or break the keep-alive connection; Content-Type; echo truncation; 422 shape;
500s counted; /v1/models tasks; output file names. A real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from omniloop_server.testing import video_events, wait_video

T = 60.0


def post_raw(url: str, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, dict[str, Any], Any]:
    """POST then GET /health on ONE http.client connection: (status, json, socket-stayed-open)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=T)
    headers = {"content-type": content_type} if content_type else {}
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        sock = conn.sock
        kept = sock is not None and r.getheader("connection", "").lower() != "close"
        conn.request("GET", "/health")
        h = conn.getresponse()
        h.read()
        assert h.status == 200
        same = kept and conn.sock is sock
        return r.status, (json.loads(data) if data else {}), same
    finally:
        conn.close()


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


# every body of the list that got HTTP 500 (raw JSON text: lone surrogates, deep nesting
# and 5000-digit integers cannot be written with json.dumps' defaults)
HOSTILE_500 = [
    ('{"\\ud800":1}', "body"),
    ('{"prompt":"\\ud800","steps":2}', "prompt"),
    ("[" * 1000 + "]" * 1000, "body"),
    ('{"prompt":"x","seed":' + "9" * 5000 + "}", "body"),
    ('{"prompt":"x","seed":' + "9" * 4000 + "}", "seed"),
    ('{"prompt":"x","seconds":1e308}', "seconds"),
    ('{"prompt":"x","seconds":"1e308"}', "seconds"),
    ('{"prompt":"x","omniloop":[1]}', "omniloop"),
    ('{"prompt":"x","omniloop":{"diffusion":5}}', "omniloop.diffusion"),
    ('{"prompt":"x","omniloop":{"diffusion":{"fps":"abc"}}}', "omniloop.diffusion.fps"),
    ('{"prompt":"x","omniloop":{"inputs":5}}', "omniloop.inputs"),
    ('{"prompt":"x","omniloop":{"request_id":[1]}}', "omniloop.request_id"),
    ('{"prompt":"x","guidance_scale":1e999}', "guidance_scale"),
    ('{"prompt":"x","omniloop":{"diffusion":{"fps":1e-300}}}', "omniloop.diffusion.fps"),
    ('{"prompt":"x","fps":1e-300}', "fps"),
]


@pytest.mark.parametrize(("raw", "param"), HOSTILE_500, ids=range(len(HOSTILE_500)))
def test_bodies_that_got_500_are_4xx_and_the_connection_survives(server: Any, raw: str, param: str) -> None:
    url, _ = server
    status, body, same = post_raw(url, "/v1/videos", raw.encode())
    assert 400 <= status < 500, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert same, "the keep-alive connection did not survive the error"


@pytest.mark.parametrize("raw", ['{"\\ud800":1}', '{"prompt":"\\ud800"}', "[" * 1000 + "]" * 1000,
                                 '{"prompt":"x","seed":' + "9" * 5000 + "}", '{"prompt":"x","omniloop":[1]}'])
def test_image_endpoint_same_bodies_are_4xx(server: Any, raw: str) -> None:
    url, _ = server
    status, body, same = post_raw(url, "/v1/images/generations", raw.encode())
    assert 400 <= status < 500 and "error" in body and same


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["guidance_scale", "fps", "seconds"])
def test_non_finite_json_literals_are_refused_before_compute(server: Any, literal: str, field: str) -> None:
    url, app = server
    status, body, _ = post_raw(url, "/v1/videos", f'{{"prompt":"x","{field}":{literal}}}'.encode())
    assert status == 400 and "non-finite" in body["error"]["message"]
    status, body, _ = post_raw(url, "/v1/videos", f'{{"prompt":"x","omniloop":{{"diffusion":{{"shift":{literal}}}}}}}'.encode())
    assert status == 400
    assert app.state.omniloop.engine.stats()["submitted"] == 0


BAD_IDS = ["/abs/dir/x", "../../etc/passwd", "../../victim/profile\u0000", "", "a" * 1_000_000, ".hidden",
           "a/b", "a\\b", "x" * 65, "-rf", "\u00e9t\u00e9"]


@pytest.mark.parametrize("rid", BAD_IDS, ids=lambda r: repr(r[:20]))
def test_client_request_ids_never_become_paths(server: Any, tmp_path: Path, rid: str) -> None:
    url, _app = server
    before = files_under(tmp_path)
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", json={"prompt": "x", "steps": 2, "omniloop": {"request_id": rid}})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "omniloop.request_id"
        assert len(r.content) < 2000  # a 1 MB id is not echoed back
    assert files_under(tmp_path) == before
    assert not Path("/abs/dir/x.mp4").exists()


def test_a_safe_client_id_is_metadata_and_files_get_server_made_names(server: Any, tmp_path: Path) -> None:
    url, app = server
    out = app.state.omniloop.jobs.output_dir
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", json={"prompt": "x", "steps": 2, "size": "16x16", "omniloop": {"request_id": "my-job_1"}})
        assert r.status_code == 200 and r.json()["id"] == "my-job_1"
        job = wait_video(c, "my-job_1", T)
        assert job["status"] == "completed"
        content = c.get("/v1/videos/my-job_1/content")
        assert content.status_code == 200 and 'filename="my-job_1.mp4"' in content.headers["content-disposition"]
    names = sorted(p.name for p in out.iterdir())
    assert any(re.fullmatch(r"[0-9a-f]{32}\.mp4", n) for n in names), names
    assert not any("my-job" in n for n in names)
    assert all(p.resolve().parent == out for p in out.iterdir())
    record = [json.loads(line) for line in (out / "jobs.jsonl").read_text().splitlines()]
    assert record[-1]["id"] == "my-job_1" and record[-1]["status"] == "completed"


def test_output_path_outside_the_folder_is_refused(tmp_path: Path, monkeypatch: Any) -> None:
    from omniloop_server import jobs

    store = jobs.JobStore(tmp_path / "out")
    (tmp_path / "out").mkdir()

    class Evil:
        hex = "../escaped"

    monkeypatch.setattr(jobs.uuid, "uuid4", lambda: Evil())
    with pytest.raises(jobs.OutputPathError):
        store.output_path()


@pytest.mark.parametrize("part", [{"type": "image", "path": "/etc/passwd"}, {"type": "video", "path": "/etc/hosts"},
                                  {"type": "latents", "path": "/tmp/x.pt"}])
def test_input_parts_naming_server_files_are_refused(server: Any, part: dict[str, Any]) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", json={"prompt": "x", "omniloop": {"inputs": [part]}})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("omniloop.inputs.0")


def test_echoed_values_are_truncated(server: Any) -> None:
    url, _ = server
    big = "z" * 1_000_000
    with httpx.Client(base_url=url, timeout=T) as c:
        for body in ({"prompt": "x", "size": big}, {"prompt": "x", big: 1}, {"prompt": "x", "omniloop": {"diffusion": {big: 1}}},
                     {"prompt": "x", "omniloop": {"plugin_params": {big: {}}}}, {"prompt": "x", "model": big}):
            r = c.post("/v1/videos", json=body)
            assert r.status_code == 422 and len(r.content) < 4000, (r.status_code, len(r.content))


@pytest.mark.parametrize(("ctype", "path"), [("text/plain", "/v1/videos"), (None, "/v1/videos"),
                                             ("application/x-www-form-urlencoded", "/v1/videos"),
                                             ("multipart/form-data; boundary=x", "/v1/images/generations"),
                                             ("text/plain", "/v1/images/generations")])
def test_content_type_is_required(server: Any, ctype: str | None, path: str) -> None:
    url, _ = server
    status, body, same = post_raw(url, path, b'{"prompt":"x","steps":2}', content_type=ctype)
    assert status == 415 and body["error"]["code"] == "unsupported_media_type" and same


def test_json_with_charset_and_empty_body_and_422_loc(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.post("/v1/videos", content=b"", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
        assert "NoneType" not in r.text
        r = c.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = c.post("/v1/videos", content=b"[1,2]", headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]
        r = c.post("/v1/videos", json={"prompt": "x", "omniloop": {"diffusion": {"shift": -1.0}}})
        assert r.json()["detail"][0]["loc"] == ["body", "omniloop", "diffusion", "shift"]
        r = c.post("/v1/videos", content=b"null", headers={"content-type": "application/json"})
        assert r.status_code == 422 and "NoneType" not in r.text


def test_an_unexpected_exception_is_a_counted_500_and_keeps_the_connection(server: Any, monkeypatch: Any) -> None:
    from omniloop_server import app as app_mod

    url, _ = server
    u = urlsplit(url)
    monkeypatch.setattr(app_mod, "render_metrics", lambda *a: 1 / 0)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=T)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 500 and body["error"]["type"] == "server_error" and "ZeroDivisionError" in body["error"]["message"]
    sock = conn.sock
    monkeypatch.undo()
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and conn.sock is sock
    conn.close()
    assert re.search(r'omniloop_http_errors_total\{code="500"\} 1\b', text)
    assert re.search(r"omniloop_http_unhandled_exceptions_total 1\b", text)


def test_unknown_route_and_method_are_openai_shaped(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        r = c.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = c.put("/v1/videos")
        assert r.status_code == 405 and "error" in r.json()


def test_models_list_the_loaded_checkpoints_tasks(server_checkpoint: Path, tmp_path: Path, monkeypatch: Any) -> None:
    from omniloop.request import TaskType
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_runtime(server_checkpoint, scheduler="step")
    # a checkpoint narrower than its family (wan-demo: t2v only)
    monkeypatch.setattr(type(rt), "supported_tasks", property(lambda self: frozenset({TaskType.T2V})), raising=False)
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0)
    with serving(app) as url, httpx.Client(base_url=url, timeout=T) as c:
        assert c.get("/v1/models").json()["data"][0]["tasks"] == ["t2v"]
        r = c.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "model"


def test_sse_has_no_progress_event_without_a_step(server: Any) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=T) as c:
        job = c.post("/v1/videos", json={"prompt": "x", "steps": 3, "size": "16x16"}).json()
        events = video_events(c, job["id"])
    progress = [d for n, d in events if n == "progress"]
    assert [(d["step"], d["total"]) for d in progress] == [(1, 3), (2, 3), (3, 3)]
    assert events[-1][0] == "done"
