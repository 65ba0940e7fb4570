"""``/v1/images/generations`` on an SD3 checkpoint through the step scheduler (the server package
is not this package: this checks that the family's ``image`` artifact serves)."""

from __future__ import annotations

import base64
import io

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("omniloop_server")


def test_images_generations_serves_sd3(tiny_ckpt, tmp_path):
    from PIL import Image

    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    manager = make_manager(("sd3", sd3_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    rt = Runtime.from_model(tiny_ckpt(), manager=manager, scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a red fox", "n": 2, "size": "32x32", "steps": 3, "seed": 5})
        assert r.status_code == 200, r.text
        imgs = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
        assert [i.size for i in imgs] == [(32, 32), (32, 32)] and imgs[0].tobytes() != imgs[1].tobytes()
        bad = c.post("/v1/images/generations", json={"prompt": "a red fox", "size": "40x40"})
        assert bad.status_code in (400, 422), bad.text
    # co-batching in the server depends on arrival timing; tests/sd3/test_batching.py proves it
