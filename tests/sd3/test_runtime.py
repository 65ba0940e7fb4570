"""The SD3 family through the runtime: discovery by entry point, diffusers' defaults, bad requests,
block interceptors and block taps on the joint blocks, the conformance kit."""

from __future__ import annotations

import inspect
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omniloop.errors import RequestError
from omniloop.request import Status
from omniloop.runtime import Runtime
from omniloop.testing import check_first_block_cache, completed_latents, make_manager
from omniloop.testing.conformance import check_family

PROMPT = "a red fox jumps over the lazy dog"


def _runtime(ckpt: Path, *plugins: tuple[str, Any], **deploy: Any) -> Runtime:
    import omniloop_sd3.plugin as sd3_plugin

    return Runtime.from_model(ckpt, manager=make_manager(("sd3", sd3_plugin), *plugins, toy=False), **deploy)


def test_from_model_discovers_the_installed_family(tiny_ckpt, t2i_request):
    rt = Runtime.from_model(tiny_ckpt())  # entry-point discovery, as a user's runtime does
    assert rt.family.name == "sd3"
    assert rt.tasks == frozenset({"t2i", "i2i"})
    out = rt.generate(t2i_request(steps=2))
    assert out.status is Status.COMPLETED, out.error
    image = out.artifacts["image"]
    assert image.pixels.dtype == torch.uint8 and tuple(image.pixels.shape) == (32, 32, 3)
    assert tuple(image.frames.shape) == (1, 32, 32, 3)
    assert tuple(out.artifacts["latents"].tensor.shape) == (1, 16, 4, 4)  # [B, C, H/8, W/8]
    assert "latents" not in rt.generate({**t2i_request(steps=1), "outputs": {}}).artifacts


def test_defaults_are_diffusers_pipeline_defaults(tiny_ckpt, tmp_path, reference):
    from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline

    from omniloop.request import TaskType
    from omniloop_sd3.defaults import defaults_for

    sig = inspect.signature(StableDiffusion3Pipeline.__call__).parameters
    sig_i2i = inspect.signature(StableDiffusion3Img2ImgPipeline.__call__).parameters
    d = defaults_for(128, 8)  # the released models: sample_size 128, VAE scale 8
    t2i, i2i = d[TaskType.T2I], d[TaskType.I2I]
    assert t2i["steps"] == sig["num_inference_steps"].default == 28
    assert t2i["guidance_scale"] == sig["guidance_scale"].default == 7.0
    assert t2i["max_sequence_length"] == sig["max_sequence_length"].default == 256
    assert (t2i["height"], t2i["width"]) == (1024, 1024)
    assert i2i["steps"] == sig_i2i["num_inference_steps"].default == 50
    assert i2i["strength"] == sig_i2i["strength"].default == 0.6

    # without omniloop.json a request giving only a prompt and a seed is diffusers' default call
    ckpt = tmp_path / "plain"
    shutil.copytree(tiny_ckpt(), ckpt)
    (ckpt / "omniloop.json").unlink()
    rt = _runtime(ckpt)
    assert rt.defaults("t2i")["steps"] == 28 and rt.defaults("t2i")["height"] == 32
    out = rt.generate({"task": "t2i", "prompt": PROMPT, "diffusion": {"seed": 3}, "outputs": {"return_latents": True}})
    assert out.metrics["steps"] == 28 and out.metrics["policies"]["sampler"] == "flow-euler"
    pipe = reference()
    assert pipe.scheduler.config.shift == 3.0
    lat = pipe(PROMPT, generator=torch.Generator().manual_seed(3), output_type="latent").images
    img = pipe(PROMPT, generator=torch.Generator().manual_seed(3)).images[0]
    assert torch.equal(completed_latents(out), lat)
    assert torch.equal(out.artifacts["image"].pixels, torch.from_numpy(np.asarray(img).copy()))


@pytest.mark.parametrize(
    "change, path",
    [
        ({"diffusion": {"height": 40}}, "diffusion.height"),
        ({"diffusion": {"width": 8}}, "diffusion.width"),
        ({"diffusion": {"height": 1024}}, "diffusion.height"),  # beyond the tiny position embedding
        ({"diffusion": {"frames": 3}}, "diffusion.frames"),
        ({"diffusion": {"guidance_scale": math.nan}}, "diffusion.guidance_scale"),
        ({"node_params": {"denoise": {"strength": 0.5}}}, "node_params.denoise.strength"),  # t2i
        ({"node_params": {"denoise": {"sampler": "nope"}}}, "node_params.denoise.sampler"),
        ({"node_params": {"text_encode": {"max_sequence_length": 0}}}, "node_params.text_encode.max_sequence_length"),
        ({"prompt": " "}, "inputs"),
    ],
)
def test_bad_t2i_requests_name_the_field(sd3_runtime, t2i_request, change, path):
    req = t2i_request()
    for k, v in change.items():
        req[k] = {**req.get(k, {}), **v} if isinstance(v, dict) else v
    with pytest.raises(RequestError) as err:
        sd3_runtime().prepare(req)
    assert err.value.path == path, str(err.value)


@pytest.mark.parametrize(
    "change, path",
    [
        ({"node_params": {"denoise": {"strength": 1.5}}}, "node_params.denoise.strength"),
        ({"node_params": {"denoise": {"strength": 0.0}}}, "node_params.denoise.strength"),
        ({"node_params": {"denoise": {"strength": math.nan}}}, "node_params.denoise.strength"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [{"type": "image", "path": "/no/such/image.png"}]}, "inputs[0].path"),
        ({"inputs": [{"type": "image", "data_b64": "not base64!"}]}, "inputs[0].data_b64"),
    ],
)
def test_bad_i2i_requests_name_the_field(sd3_runtime, i2i_request, change, path):
    req = i2i_request()
    req.update(change)
    rt = sd3_runtime()
    with pytest.raises(RequestError) as err:
        ex = rt.prepare(req)
        ex.run()  # image decoding errors surface at validate (before any compute) if not at prepare
        assert ex.output.status is Status.COMPLETED
    assert err.value.path == path, str(err.value)


def test_block_interceptors_and_taps_run_on_the_joint_blocks(tiny_ckpt, t2i_request):
    import omniloop_fbcache.plugin as fbcache_plugin

    check_first_block_cache(lambda *p, **d: _runtime(tiny_ckpt(), *p, **d), fbcache_plugin, t2i_request(steps=6))


def test_block_taps_see_every_joint_block(tiny_ckpt, t2i_request):
    from omniloop.testing import block_taps

    seen = block_taps(lambda *p, **d: _runtime(tiny_ckpt(), *p, **d), t2i_request(steps=1))
    blocks = sorted({n for n, _ in seen if "transformer_blocks" in n})
    assert blocks == [f"transformer.transformer_blocks.{i}" for i in range(3)], blocks
    # each block output is the joint sequence [context ; image]: 77 + 256 text tokens + 4 image tokens
    assert all(s == (2, 77 + 256 + 4, 16) for n, s in seen if "transformer_blocks" in n)


def test_conformance_kit(sd3_runtime):
    check_family(lambda: sd3_runtime(), {"task": "t2i", "prompt": PROMPT, "diffusion": {"steps": 2}}, output="image")


def test_cli_generate_writes_a_png(tiny_ckpt, tmp_path, init_image):
    from click.testing import CliRunner
    from PIL import Image

    import omniloop_sd3.plugin as sd3_plugin
    from omniloop_cli import cli

    manager = make_manager(("sd3", sd3_plugin), toy=False)
    out = tmp_path / "fox.png"
    res = CliRunner().invoke(cli, ["generate", "a red fox", "--model", str(tiny_ckpt()), "--task", "t2i", "--steps", "2",
                                   "--seed", "1", "--out", str(out)], obj=manager)
    assert res.exit_code == 0, res.output
    assert Image.open(out).size == (32, 32)
    out2 = tmp_path / "edit.png"
    res = CliRunner().invoke(cli, ["generate", "a red fox", "--model", str(tiny_ckpt()), "--task", "i2i", "--image",
                                   str(init_image), "--steps", "2", "--out", str(out2)], obj=manager)
    assert res.exit_code == 0, res.output
    assert Image.open(out2).size == (32, 32)
    bad = CliRunner().invoke(cli, ["generate", "x", "--model", str(tiny_ckpt()), "--task", "t2i", "--height", "40"],
                             obj=manager)
    assert bad.exit_code == 2 and "diffusion.height" in bad.output


def test_cache_dit_interceptor_runs_on_the_joint_blocks(tiny_ckpt, t2i_request):
    pytest.importorskip("cache_dit")
    import omniloop_cache_dit.plugin as cache_dit_plugin
    from omniloop.testing import check_block_cache

    # cached steps with the cache; an exact request runs without it: the baseline exactly
    check_block_cache(lambda *p, **d: _runtime(tiny_ckpt(), *p, **d), "cache-dit", cache_dit_plugin,
                      {"Fn": 1, "Bn": 0, "residual_diff_threshold": 0.5, "max_warmup_steps": 2}, t2i_request(steps=8))


def test_requests_are_resolved_once_with_their_workload(sd3_runtime, t2i_request, i2i_request, monkeypatch):
    from omniloop_sd3 import resolve as resolve_mod
    from omniloop_sd3.resolve import SD3Params

    calls = []
    real = resolve_mod.resolve

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr("omniloop_sd3.family.resolve", counting)
    monkeypatch.setattr("omniloop_sd3.stages.resolve", counting)
    rt = sd3_runtime()
    ex = rt.prepare(i2i_request(steps=10, strength=0.5))
    assert isinstance(ex.resolved, SD3Params) and len(calls) == 1
    w = ex.resolved.workload()
    assert (w.steps, w.branches, w.frames, w.height, w.width) == (5, 2, 1, 32, 32)
    ex.run()
    assert ex.output.status is Status.COMPLETED and len(calls) == 1  # the validate node reuses it
    assert ex.output.metrics["steps"] == 5
    assert rt.prepare(t2i_request(guidance_scale=1.0)).resolved.workload().branches == 1
