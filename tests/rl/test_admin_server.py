"""The server's admin routes (omniloop_server.admin): token auth, rollouts, weight updates, sleep/wake."""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import load_file, save

httpx = pytest.importorskip("httpx")
pytest.importorskip("omniloop_server")

TOKEN = "s3cret-token"


@pytest.fixture
def admin_app(rl_ckpt, fresh_runtime, tmp_path, monkeypatch):
    from omniloop_server import create_app

    monkeypatch.setenv("OMNILOOP_TEST_ADMIN", TOKEN)
    rt = fresh_runtime(rl_ckpt("flux"), step=True, admin={"token_env": "OMNILOOP_TEST_ADMIN"})
    return rt, create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)


def _client(app):
    from omniloop_server.testing import serving

    return serving(app)


AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROLLOUT = {"task": "t2i", "prompt": "a red fox", "diffusion": {"steps": 3, "seed": 4, "height": 64, "width": 64, "num_outputs": 2},
           "rollout": {"kind": "sde"}}


def test_admin_routes_off_without_admin(rl_ckpt, fresh_runtime, tmp_path):
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    app = create_app(fresh_runtime(rl_ckpt("flux"), step=True), output_dir=tmp_path / "o", shutdown_timeout=0)
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/v1/weights/checksum", headers=AUTH).status_code == 404
        assert c.post("/v1/sleep", headers=AUTH).status_code in (404, 405)


def test_admin_needs_its_variable(rl_ckpt, fresh_runtime, tmp_path, monkeypatch):
    from omniloop.errors import DeployError
    from omniloop_server import create_app

    monkeypatch.delenv("OMNILOOP_TEST_ADMIN_UNSET", raising=False)
    rt = fresh_runtime(rl_ckpt("flux"), step=True, admin={"token_env": "OMNILOOP_TEST_ADMIN_UNSET"})
    with pytest.raises(DeployError, match="OMNILOOP_TEST_ADMIN_UNSET"):
        create_app(rt, output_dir=tmp_path / "o", shutdown_timeout=0)


@pytest.mark.parametrize("route,method", [("/v1/rollout/generate", "post"), ("/v1/weights/update", "post"),
                                          ("/v1/weights/checksum", "get"), ("/v1/sleep", "post"), ("/v1/wake", "post")])
def test_missing_or_wrong_token(admin_app, route, method):
    rt, app = admin_app
    with _client(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = getattr(c, method)(route)
        assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
        r = getattr(c, method)(route, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403
        r = getattr(c, method)(route, headers={"Authorization": f"Basic {TOKEN}"})
        assert r.status_code == 403
    assert not rt.asleep and rt.weight_version != "x"


def test_rollout_update_checksum_sleep_wake(admin_app, rl_ckpt):
    rt, app = admin_app
    sd = load_file(str(rl_ckpt("flux") / "transformer" / "diffusion_pytorch_model.safetensors"))
    new = {k: v + 0.01 for k, v in sd.items()}
    with _client(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/rollout/generate", json=ROLLOUT, headers=AUTH)
        assert r.status_code == 200, r.text
        samples = r.json()["samples"]
        assert [s["seed"] for s in samples] == [4, 5] and all(s["status"] == "completed" for s in samples)
        tr = samples[0]["trajectory"]
        assert len(tr["log_probs"]) == 3 and len(tr["sigmas"]) == 4 and samples[0]["image_png_b64"]
        lat = torch.frombuffer(bytearray(base64.b64decode(tr["latents"]["data_b64"])), dtype=torch.float32)
        assert list(lat.reshape(tr["latents"]["shape"]).shape) == [4, 4, 8, 8]
        # the same rollout through the Python API: the same trajectory
        alone = rt.generate({**ROLLOUT, "diffusion": {**ROLLOUT["diffusion"], "num_outputs": None}})
        assert alone.artifacts["trajectory"].log_probs.tolist() == pytest.approx(tr["log_probs"], abs=1e-5)

        before = c.get("/v1/weights/checksum", headers=AUTH).json()
        bad = {**new, "not.a.weight": torch.zeros(2)}
        r = c.post("/v1/weights/update", headers=AUTH,
                   json={"version": "v1", "source": {"safetensors_b64": base64.b64encode(save(bad)).decode()}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "source.not.a.weight"
        assert c.get("/v1/weights/checksum", headers=AUTH).json() == before  # nothing half-applied
        for body, param in [({"source": {"safetensors_b64": "x"}}, "version"),
                            ({"version": "v1", "source": {"path": "/etc/passwd"}}, "source.path"),
                            ({"version": "v1", "source": {"file": "a.safetensors"}}, "source.file"),
                            ({"version": "v1", "source": {"safetensors_b64": "%%%"}}, "source.safetensors_b64"),
                            ({"version": "../x", "source": {"safetensors_b64": base64.b64encode(save(new)).decode()}}, "version")]:
            r = c.post("/v1/weights/update", headers=AUTH, json=body)
            assert r.status_code == 422 and r.json()["error"]["param"] == param, (body, r.text)
        r = c.post("/v1/weights/update", headers=AUTH,
                   json={"version": "v1", "source": {"safetensors_b64": base64.b64encode(save(new)).decode()}})
        assert r.status_code == 200, r.text
        after = c.get("/v1/weights/checksum", headers=AUTH).json()
        assert after["weight_version"] == "v1" and after["checksum"] == r.json()["checksum"] != before["checksum"]
        # the host-side SHA-256 on request; a bad algorithm or query parameter is one 422 naming it
        slow = c.get("/v1/weights/checksum", params={"algorithm": "sha256"}, headers=AUTH).json()
        assert slow["checksum"] == rt.weights_checksum("sha256") and slow["checksum"].startswith("sha256:")
        assert after["checksum"].startswith("mix128:")
        for params, param in [({"algorithm": "md5"}, "algorithm"), ({"algo": "sha256"}, "algo")]:
            r2 = c.get("/v1/weights/checksum", params=params, headers=AUTH)
            assert r2.status_code == 422 and r2.json()["error"]["param"] == param, r2.text
        r = c.post("/v1/rollout/generate", json=ROLLOUT, headers=AUTH)
        assert [s["weight_version"] for s in r.json()["samples"]] == ["v1", "v1"]

        assert c.post("/v1/sleep", headers=AUTH).json()["asleep"] is True
        assert c.get("/v1/weights/checksum", headers=AUTH).status_code == 409
        assert c.post("/v1/wake", headers=AUTH).json()["asleep"] is False
        assert c.get("/v1/weights/checksum", headers=AUTH).json() == after


def test_update_waits_for_in_flight_rollouts(admin_app, rl_ckpt):
    """Through the server (the engine's worker thread drives the requests): an update posted while a
    rollout is in flight returns after it finished; the rollout ran on its starting version."""
    import threading
    import time

    rt, app = admin_app
    first = rt.weight_version
    sd = load_file(str(rl_ckpt("flux") / "transformer" / "diffusion_pytorch_model.safetensors"))
    blob = base64.b64encode(save({k: v * 1.01 for k, v in sd.items()})).decode()
    long = {**ROLLOUT, "diffusion": {**ROLLOUT["diffusion"], "steps": 40, "num_outputs": 1}}
    result: dict = {}
    with _client(app) as url, httpx.Client(base_url=url, timeout=300) as c:
        def rollout() -> None:
            result["r"] = c.post("/v1/rollout/generate", json=long, headers=AUTH)

        th = threading.Thread(target=rollout)
        th.start()
        deadline = time.monotonic() + 60
        while rt.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert rt.in_flight == 1
        r = c.post("/v1/weights/update", headers=AUTH, json={"version": "v9", "source": {"safetensors_b64": blob}})
        assert r.status_code == 200, r.text
        assert rt.in_flight == 0  # the update returned only once the rollout had finished
        th.join()
    sample = result["r"].json()["samples"][0]
    assert sample["status"] == "completed" and sample["weight_version"] == first != "v9"
    assert rt.weight_version == "v9"
