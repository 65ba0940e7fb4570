"""FLUX.1 behind ``omniloop serve``: ``POST /v1/images/generations`` (OpenAI-style) through the step
scheduler returns PNGs equal to the Python API's images of the same seeds (``n`` images get seeds
``seed + i``; the step scheduler batches their steps, within one uint8 level of each alone)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("omniloop_server")


def test_images_generations_returns_the_family_images(flux_runtime, tmp_path):
    from PIL import Image

    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = flux_runtime("dev", scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/images/generations",
                   json={"prompt": "a red fox", "n": 2, "size": "48x64", "steps": 2, "seed": 5})
        assert r.status_code == 200, r.text
        imgs = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in r.json()["data"]]
        models = c.get("/v1/models").json()["data"]
    assert models[0]["family"] == "flux" and "t2i" in models[0]["tasks"]
    alone = flux_runtime("dev")
    for i, img in enumerate(imgs):
        assert img.shape == (64, 48, 3)
        ref = alone.generate({"task": "t2i", "prompt": "a red fox",
                              "diffusion": {"steps": 2, "seed": 5 + i, "height": 64, "width": 48}})
        diff = np.abs(img.astype(int) - ref.artifacts["image"].pixels.numpy().astype(int)).max()
        assert diff <= 1
