"""ComfyUI's routes on a real server (uvicorn on loopback, a tiny FLUX.1 [schnell] checkpoint),
driven by a ComfyUI client from PyPI (``comfy-api-simplified``: queue, follow the WebSocket to
completion, fetch the image through /history + /view) and by raw HTTP for the error shapes."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
import torch

from omniloop.runtime import Runtime
from omniloop_comfyui.routes import comfyui_routes
from omniloop_comfyui.ui import to_api_format
from omniloop_server.app import create_app
from omniloop_server.testing import serving


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    import omniloop_flux.plugin as flux_plugin
    import omniloop_scheduler.plugin as sched_plugin
    from omniloop.testing import make_manager

    ckpt = tiny("flux", "schnell")
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", scheduler="step",
                            manager=make_manager(("flux", flux_plugin), ("scheduler", sched_plugin), toy=False,
                                                 scheduler=False),
                            comfyui={"models": {"flux1-schnell-fp8.safetensors": ckpt.name}})
    out = tmp_path_factory.mktemp("comfy-out")
    app = create_app(rt, output_dir=out, route_extensions={"comfyui": comfyui_routes})
    with serving(app) as url:
        yield url, rt, out


def _workflow(templates, widgets):
    wf = widgets(templates("flux_schnell"), 27, width=64, height=64)
    return to_api_format(wf)


def test_client_queues_follows_ws_and_fetches(server, templates, widgets):
    api = pytest.importorskip("comfy_api_simplified")
    url, rt, _ = server
    prompt = api.ComfyWorkflowWrapper(_workflow(templates, widgets))
    prompt.set_node_param("KSampler", "seed", 11)
    client = api.ComfyApiWrapper(url)
    files = client.queue_and_wait_images(prompt, "SaveImage")
    (name, data), = files.items()
    assert name.endswith("_.png")
    from PIL import Image

    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())
    native = rt.generate({"task": "t2i", "inputs": [{"type": "text", "text": prompt["6"]["inputs"]["text"]}],
                          "diffusion": {"seed": 11, "steps": 4, "width": 64, "height": 64, "shift": float(np.e)},
                          "node_params": {"denoise": {"sampler": "flow-euler"}}})
    assert torch.equal(pixels, native.artifacts["image"].pixels)
    assert client.get_queue() == {"queue_running": [], "queue_pending": []}
    info = client.get_object_info("KSampler")
    assert "euler" in info["KSampler"]["input"]["required"]["sampler_name"][0]


def test_ws_messages(server, templates, widgets):
    import asyncio

    import websockets

    url, _, _ = server
    prompt = _workflow(templates, widgets)

    async def go():
        async with websockets.connect(url.replace("http", "ws") + "/ws?clientId=abc") as ws:
            first = json.loads(await ws.recv())
            assert first["type"] == "status" and first["data"]["sid"] == "abc"
            async with httpx.AsyncClient() as c:
                r = await c.post(f"{url}/prompt", json={"prompt": prompt, "client_id": "abc"})
            assert r.status_code == 200, r.text
            pid = r.json()["prompt_id"]
            seen = []
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 120))
                seen.append(m)
                if m["type"] == "execution_success":
                    break
            return pid, seen

    pid, seen = asyncio.run(go())
    types = [m["type"] for m in seen]
    for t in ("execution_start", "executing", "progress", "executed", "execution_success"):
        assert t in types
    done = [m for m in seen if m["type"] == "executing" and m["data"]["node"] is None]
    assert done and done[0]["data"]["prompt_id"] == pid
    executed = next(m for m in seen if m["type"] == "executed")["data"]
    assert executed["node"] == "9" and executed["output"]["images"][0]["type"] == "output"
    hist = httpx.get(f"{url}/history/{pid}").json()
    assert hist[pid]["status"]["completed"] is True
    img = hist[pid]["outputs"]["9"]["images"][0]
    r = httpx.get(f"{url}/view", params=img)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"


def _post(url, prompt):
    return httpx.post(f"{url}/prompt", json={"prompt": prompt})


def test_error_shapes(server, templates, widgets):
    url, _, _ = server
    base = _workflow(templates, widgets)

    r = _post(url, {**base, "99": {"class_type": "NoSuchNode", "inputs": {}}})
    assert r.status_code == 400
    body = r.json()
    assert body["error"]["type"] == "missing_node_type" and body["error"]["extra_info"]["node_id"] == "99"

    bad = json.loads(json.dumps(base))
    bad["31"]["inputs"]["steps"] = 0
    bad["31"]["inputs"]["sampler_name"] = "nope"
    bad["9"]["inputs"]["filename_prefix"] = "../../etc/x"
    r = _post(url, bad)
    assert r.status_code == 400
    ne = r.json()["node_errors"]
    assert r.json()["error"]["type"] == "prompt_outputs_failed_validation"
    assert {e["type"] for e in ne["31"]["errors"]} == {"value_smaller_than_min", "value_not_in_list"}
    assert ne["31"]["class_type"] == "KSampler"

    cyc = json.loads(json.dumps(base))
    cyc["30"]["inputs"]["ckpt_name"] = ["8", 0]  # a link into a widget: wrong type
    cyc["8"]["inputs"]["samples"] = ["31", 0]
    cyc["31"]["inputs"]["latent_image"] = ["8", 0]  # 8 -> 31 -> 8
    r = _post(url, cyc)
    assert r.status_code == 400 and "dependency_cycle" in json.dumps(r.json())

    dang = json.loads(json.dumps(base))
    dang["8"]["inputs"]["vae"] = ["404", 2]
    r = _post(url, dang)
    assert r.status_code == 400 and r.json()["node_errors"]["8"]["errors"][0]["type"] == "dangling_link"

    wrong = json.loads(json.dumps(base))
    wrong["30"]["inputs"]["ckpt_name"] = "other-model.safetensors"
    r = _post(url, wrong)
    assert r.status_code == 400
    err = r.json()["node_errors"]["30"]["errors"][0]
    assert err["extra_info"]["input_name"] == "ckpt_name"

    for body in (b"{", b"[]", json.dumps({"prompt": []}).encode(), json.dumps({"prompt": {"1": 3}}).encode()):
        r = httpx.post(f"{url}/prompt", content=body)
        assert r.status_code == 400, body

    for params in ({"filename": "../jobs.jsonl"}, {"filename": "x.png", "subfolder": "../.."},
                   {"filename": "/etc/passwd"}, {"filename": "a.png", "type": "secret"}):
        r = httpx.get(f"{url}/view", params=params)
        assert r.status_code in (400, 404), params
    assert httpx.get(f"{url}/view", params={"filename": "missing.png"}).status_code == 404
    assert httpx.post(f"{url}/interrupt").status_code == 200


def test_route_extension_point(tmp_path, monkeypatch):
    """``omniloop serve`` gets one --no-<name> flag per installed extension; extensions mount after
    the built-in routes; one that fails to import is skipped; without extensions no ComfyUI route."""
    import importlib.metadata as md

    from omniloop.testing import build_toy_checkpoint, toy_runtime
    from omniloop_server import extensions
    from omniloop_server.cli import make_serve_command

    assert "comfyui" in extensions.installed()
    names = {p.opts[0] for p in make_serve_command().params}
    assert "--no-comfyui" in names
    broken = md.EntryPoint(name="broken", value="no_such_module_xyz:routes", group=extensions.GROUP)
    monkeypatch.setattr(extensions, "installed", lambda: {"broken": broken, **{
        ep.name: ep for ep in md.entry_points(group=extensions.GROUP)}})
    loaded = extensions.load()
    assert "broken" not in loaded and "comfyui" in loaded
    assert "comfyui" not in extensions.load({"comfyui"})

    rt = toy_runtime(build_toy_checkpoint(tmp_path / "toy"))
    plain = create_app(rt, output_dir=tmp_path / "a")
    assert not any(getattr(r, "path", None) == "/prompt" for r in plain.routes)
    with_ext = create_app(rt, output_dir=tmp_path / "b", route_extensions={"comfyui": comfyui_routes})
    paths = [getattr(r, "path", None) for r in with_ext.routes]
    assert paths.index("/prompt") > paths.index("/v1/videos")


def test_upload_then_img2img(server, tmp_path):
    """comfy-api-simplified's upload_image, then an img2img prompt naming the returned file."""
    api = pytest.importorskip("comfy_api_simplified")
    from PIL import Image

    url, rt, _ = server
    path = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    client = api.ComfyApiWrapper(url)
    up = client.upload_image(str(path))
    assert up["subfolder"] == "default_upload_folder" and up["type"] == "input" and up["name"] != "cat.png"
    name = f"{up['subfolder']}/{up['name']}"
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-schnell-fp8.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["1", 1]}},
        "3": {"class_type": "LoadImage", "inputs": {"image": name}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["1", 2]}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 2, "steps": 2, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 0],
                                                   "negative": ["2", 0], "latent_image": ["4", 0], "denoise": 0.5}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "cat"},
              "_meta": {"title": "Save"}},
    }
    for node in prompt.values():  # as ComfyUI exports the API format (the client looks nodes up by title)
        node.setdefault("_meta", {"title": node["class_type"]})
    files = client.queue_and_wait_images(prompt, "Save")
    (data,) = files.values()
    import base64

    native = rt.generate({"task": "i2i", "inputs": [{"type": "text", "text": "a cat"},
                                                    {"type": "image", "data_b64": base64.b64encode(path.read_bytes()).decode()}],
                          "diffusion": {"seed": 2, "steps": 4, "width": 64, "height": 64, "shift": float(np.e)},
                          "node_params": {"denoise": {"sampler": "flow-euler", "strength": 0.5}}})
    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())
    assert torch.equal(pixels, native.artifacts["image"].pixels)
    for bad in ({"files": {"image": ("x.png", b"not an image")}}, {"files": {"image": ("x.png", path.read_bytes())},
                                                                    "data": {"subfolder": "../up"}},
                {"data": {"image": "text"}}):
        assert httpx.post(f"{url}/upload/image", **bad).status_code == 400


def test_interrupt(server, templates, widgets):
    import asyncio

    import websockets

    url, _, _ = server
    prompt = _workflow(templates, widgets)
    prompt["31"]["inputs"]["steps"] = 200  # long enough to interrupt (divides FLUX.1's 10000-entry table)

    async def go():
        async with websockets.connect(url.replace("http", "ws") + "/ws?clientId=int1") as ws:
            await ws.recv()
            async with httpx.AsyncClient() as c:
                r = await c.post(f"{url}/prompt", json={"prompt": prompt, "client_id": "int1"})
                pid = r.json()["prompt_id"]
                seen = []
                while True:
                    m = json.loads(await asyncio.wait_for(ws.recv(), 120))
                    seen.append(m)
                    if m["type"] == "progress":
                        assert (await c.post(f"{url}/interrupt")).status_code == 200
                    if m["type"] in ("execution_interrupted", "execution_success", "execution_error"):
                        return pid, seen

    pid, seen = asyncio.run(go())
    assert seen[-1]["type"] == "execution_interrupted" and seen[-1]["data"]["prompt_id"] == pid
    progress = [m["data"]["value"] for m in seen if m["type"] == "progress"]
    assert progress and max(progress) < 200
    hist = httpx.get(f"{url}/history/{pid}").json()[pid]
    assert hist["status"]["status_str"] == "error" and hist["outputs"] == {}
    executing = [m["data"]["node"] for m in seen if m["type"] == "executing"]
    assert executing[0] == "31"


def test_two_requests_with_data_flow(server):
    """A t2i chain whose decoded image feeds an img2img chain: two engine requests, in order."""
    import time

    url, rt, _ = server
    base = {"seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "model": ["1", 0],
            "positive": ["2", 0], "negative": ["2", 0], "denoise": 1.0}
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-schnell-fp8.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a dog", "clip": ["1", 1]}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "KSampler", "inputs": {**base, "latent_image": ["3", 0]}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["1", 2]}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "first"}},
        "7": {"class_type": "VAEEncode", "inputs": {"pixels": ["5", 0], "vae": ["1", 2]}},
        "8": {"class_type": "KSampler", "inputs": {**base, "latent_image": ["7", 0], "denoise": 0.5, "seed": 4}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "second"}},
    }
    r = httpx.post(f"{url}/prompt", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    pid = r.json()["prompt_id"]
    deadline = time.monotonic() + 120
    while True:
        hist = httpx.get(f"{url}/history/{pid}").json()
        if hist:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    entry = hist[pid]
    assert entry["status"]["completed"] is True and sorted(entry["outputs"]) == ["10", "6"]
    from PIL import Image

    def pixels(node):
        img = entry["outputs"][node]["images"][0]
        data = httpx.get(f"{url}/view", params=img).content
        return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())

    first = rt.generate({"task": "t2i", "inputs": [{"type": "text", "text": "a dog"}],
                         "diffusion": {"seed": 3, "steps": 2, "width": 64, "height": 64, "shift": float(np.e)},
                         "node_params": {"denoise": {"sampler": "flow-euler"}}})
    assert torch.equal(pixels("6"), first.artifacts["image"].pixels)
    buf = io.BytesIO()
    Image.fromarray(first.artifacts["image"].pixels.numpy()).save(buf, format="PNG")
    import base64

    second = rt.generate({"task": "i2i", "inputs": [{"type": "text", "text": "a dog"},
                                                    {"type": "image", "data_b64": base64.b64encode(buf.getvalue()).decode()}],
                          "diffusion": {"seed": 4, "steps": 4, "width": 64, "height": 64, "shift": float(np.e)},
                          "node_params": {"denoise": {"sampler": "flow-euler", "strength": 0.5}}})
    assert torch.equal(pixels("10"), second.artifacts["image"].pixels)


def test_runtime_checks_at_prompt(server, templates, widgets):
    """What only the family can check (a size the model cannot do, a deploy limit) is a 400 node
    error at /prompt, as ComfyUI validates before queueing — not a later execution_error."""
    url, _, _ = server
    prompt = _workflow(templates, widgets)
    prompt["31"]["inputs"]["steps"] = 400  # above the deploy's max_steps (200); divides FLUX.1's table
    r = _post(url, prompt)
    assert r.status_code == 400, r.text
    err = r.json()["node_errors"]["31"]
    assert err["errors"][0]["type"] == "invalid_request" and "steps" in err["errors"][0]["extra_info"]["field"]
    assert err["dependent_outputs"] == ["9"]
