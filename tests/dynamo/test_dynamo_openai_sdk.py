"""The official ``openai`` SDK through a real Dynamo 1.6.1 frontend with omniloop workers (issue 23).

What works and what does not is what the omniloop-dynamo README states (its "With the OpenAI SDK"
section): the frontend takes JSON only (the SDK's multipart ``videos.create`` / ``images.edit``
get 415), its ``/v1/videos`` is synchronous (the answer is the finished video; there is no
retrieve / poll / content / list / delete route), and it routes only the model types a worker
registers (videos and images: chat gets 404). Video and image calls that go as JSON work, with the
same ``extra_body`` knobs as against ``omniloop serve``, and give the same pictures.

Skipped unless ai-dynamo is installed (see conftest.py); loopback only, every call bounded.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from openai import OpenAI, Stream  # noqa: E402
from openai.types import Video  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

T = 120.0


def _png(size: int = 64, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _pixels(b64: str | None) -> np.ndarray:
    from PIL import Image

    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def _frames(b64: str) -> int:
    import av

    with av.open(io.BytesIO(base64.b64decode(b64))) as c:
        return sum(1 for _ in c.decode(video=0))


def test_the_sdk_through_the_frontend_on_toy(deployment_factory: Any, tmp_path: Path) -> None:
    from omniloop.testing import build_toy_checkpoint
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    ckpt = build_toy_checkpoint(tmp_path / "toy")
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(ckpt), "family": "toy"}, "scheduler": "serial"}))
    dep = deployment_factory("sdk-toy")
    dep.start_frontend()
    dep.start_worker("toy", deploy, "toy", "--manager-factory", "omniloop.testing:make_manager")
    dep.wait_ready("toy", instances=2)
    client = OpenAI(base_url=f"{dep.url}/v1", api_key="none", max_retries=0, timeout=T)

    assert [m.id for m in client.models.list()] == ["toy"]

    # /v1/videos is synchronous and JSON-only: post the body as JSON; the answer is the finished video
    video = client.post("/videos", cast_to=Video, body={
        "model": "toy", "prompt": "a red dot", "seconds": 1, "size": "16x16", "response_format": "b64_json",
        "steps": 2, "seed": 1})
    assert video.status == "completed" and video.progress == 100
    assert _frames(video.model_extra["data"][0]["b64_json"]) == 9  # 1 s at the toy's 8 fps, + the frame at t=0

    # with stream=True the worker sends progress chunks, then the video
    stream = client.post("/videos", cast_to=object, body={
        "model": "toy", "prompt": "a red dot", "size": "16x16", "response_format": "b64_json", "stream": True,
        "steps": 3}, stream=True, stream_cls=Stream[object])
    chunks = list(stream)
    assert [c["status"] for c in chunks] == ["in_progress"] * (len(chunks) - 1) + ["completed"]
    assert [c["progress"] for c in chunks[:-1]] == sorted(c["progress"] for c in chunks[:-1])
    assert chunks[-1]["data"][0]["b64_json"]

    # images.generate is JSON: it works as against omniloop serve, extra_body included
    result = client.images.generate(model="toy", prompt="a cat", n=2, size="16x16", response_format="b64_json",
                                    extra_body={"steps": 2, "seed": 3})
    assert len(result.data) == 2 and result.output_format == "png"
    rt = make_runtime(ckpt, scheduler="serial")
    with serving(create_app(rt, output_dir=tmp_path / "serve-out", shutdown_timeout=0)) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T) as direct:
        same = direct.images.generate(model="toy", prompt="a cat", n=2, size="16x16", response_format="b64_json",
                                      extra_body={"steps": 2, "seed": 3})
    for a, b in zip(result.data, same.data, strict=True):
        assert np.array_equal(_pixels(a.b64_json), _pixels(b.b64_json))

    # errors: our message as a 400 (the frontend's status for InvalidArgument)
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.generate(model="toy", prompt="a cat", size="30x30")
    assert "size" in exc.value.message and "multiple of 4" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.post("/videos", cast_to=Video, body={"model": "toy", "prompt": "x", "steps": 2,
                                                    "nvext": {"num_inference_steps": 3}})
    assert "steps" in exc.value.message and "given twice" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="dall-e-3", prompt="a cat")

    # what the frontend does not offer
    with pytest.raises(openai.APIStatusError) as exc:  # multipart
        client.videos.create(model="toy", prompt="a red dot", size="16x16")
    assert exc.value.status_code == 415
    with pytest.raises(openai.BadRequestError):  # the SDK's seconds are strings; the frontend wants an integer
        client.post("/videos", cast_to=Video, body={"model": "toy", "prompt": "x", "seconds": "1"})
    with pytest.raises(openai.NotFoundError):  # no job store: nothing to retrieve, poll or download
        client.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(video.id)
    with pytest.raises(openai.APIStatusError) as exc:
        client.images.edit(model="toy", image=("a.png", _png(16), "image/png"), prompt="x")
    assert exc.value.status_code == 415
    with pytest.raises(openai.NotFoundError):  # the worker registers no chat model
        client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}])
    client.close()


def test_image_to_image_through_the_frontend_on_flux(deployment_factory: Any, tmp_path: Path) -> None:
    """``images.edit`` cannot pass the frontend (multipart); ``images.generate`` with
    ``input_reference`` (a data: URL) and ``strength`` in ``extra_body`` is the same i2i request."""
    pytest.importorskip("diffusers")
    pytest.importorskip("omniloop_flux")
    from omniloop.runtime import Runtime
    from omniloop_flux.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny-flux")
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(ckpt), "family": "flux"}, "device": "cpu",
                                  "dtype": "float32", "scheduler": "step"}))
    dep = deployment_factory("sdk-flux")
    dep.start_frontend()
    dep.start_worker("flux", deploy, "tiny-flux")
    dep.wait_ready("tiny-flux", instances=1)
    image = _png()
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    with OpenAI(base_url=f"{dep.url}/v1", api_key="none", max_retries=0, timeout=T) as client:
        result = client.images.generate(model="tiny-flux", prompt="a red fox in the snow", size="64x64",
                                        response_format="b64_json",
                                        extra_body={"input_reference": data_url, "strength": 0.5, "steps": 4, "seed": 3})
    ref = Runtime.from_deploy(deploy).generate({
        "task": "i2i", "prompt": "a red fox in the snow", "inputs": [{"type": "image", "data_b64": base64.b64encode(image).decode()}],
        "diffusion": {"steps": 4, "seed": 3, "height": 64, "width": 64}, "node_params": {"denoise": {"strength": 0.5}},
    }).artifacts["image"].pixels.numpy().astype(int)
    assert int(np.abs(_pixels(result.data[0].b64_json) - ref).max()) <= 1
