"""Bit-exact parity with diffusers' ``FluxPipeline`` / ``FluxImg2ImgPipeline`` (CPU, float32, tiny
random checkpoints; bfloat16 too for t2i): final latents (unpacked ``[1, C, H/8, W/8]``) and the uint8 image, compared
with ``torch.equal``. Same checkpoint folder, same seed on a CPU generator, same steps and size;
diffusers runs with its defaults except ``max_sequence_length``, which the tiny checkpoint's
``omniloop.json`` sets to 32 for us (so both read 32 T5 tokens).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from omniloop.request import Status

MAX_LEN = 32


def _pipe(cls_name: str, path):
    import diffusers

    return getattr(diffusers, cls_name).from_pretrained(path, dtype=torch.float32)


def _diffusers(pipe, seed: int, output_type: str, **kw):
    g = torch.Generator("cpu").manual_seed(seed)
    out = pipe(generator=g, max_sequence_length=MAX_LEN, output_type=output_type, **kw).images
    if output_type == "latent":
        return pipe._unpack_latents(out, kw["height"], kw["width"], pipe.vae_scale_factor)
    return out


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("size", [(64, 64), (64, 48)])
def test_t2i_bit_exact(flux_ckpt, flux_runtime, make_t2i, to_uint8, variant, size):
    h, w = size
    out = flux_runtime(variant).generate(make_t2i(seed=7, steps=3, height=h, width=w))
    assert out.status is Status.COMPLETED, out.error
    pipe = _pipe("FluxPipeline", flux_ckpt(variant))
    kw = dict(prompt="a red fox jumps over the lazy dog", num_inference_steps=3, height=h, width=w)
    ref_lat = _diffusers(pipe, 7, "latent", **kw)
    ref_img = to_uint8(_diffusers(pipe, 7, "np", **kw))
    lat = out.artifacts["latents"].tensor
    img = out.artifacts["image"].frames
    assert lat.shape == (1, 4, h // 8, w // 8)
    assert img.shape == (1, h, w, 3) and img.dtype == torch.uint8
    assert torch.equal(lat, ref_lat)
    assert torch.equal(img, ref_img)


def test_dev_guidance_scale_reaches_the_model(flux_runtime, make_t2i):
    """Embedded guidance: another scale gives another image (schnell has no guidance input)."""
    a = flux_runtime("dev").generate(make_t2i(guidance_scale=3.5)).artifacts["latents"].tensor
    b = flux_runtime("dev").generate(make_t2i(guidance_scale=1.0)).artifacts["latents"].tensor
    assert not torch.equal(a, b)
    c = flux_runtime("schnell").generate(make_t2i(guidance_scale=3.5)).artifacts["latents"].tensor
    d = flux_runtime("schnell").generate(make_t2i(guidance_scale=1.0)).artifacts["latents"].tensor
    assert torch.equal(c, d)


@pytest.mark.parametrize("variant, strength", [("dev", None), ("dev", 0.9), ("schnell", 0.5)])
def test_i2i_bit_exact(flux_ckpt, flux_runtime, make_i2i, to_uint8, input_png, variant, strength):
    req = make_i2i(input_png, seed=3, steps=5, height=64, width=64)
    kw = dict(prompt="a blue cat", image=Image.open(input_png), num_inference_steps=5, height=64, width=64)
    if strength is not None:  # else both use their default, 0.6
        req["node_params"] = {"denoise": {"strength": strength}}
        kw["strength"] = strength
    out = flux_runtime(variant).generate(req)
    assert out.status is Status.COMPLETED, out.error
    pipe = _pipe("FluxImg2ImgPipeline", flux_ckpt(variant))
    assert torch.equal(out.artifacts["latents"].tensor, _diffusers(pipe, 3, "latent", **kw))
    assert torch.equal(out.artifacts["image"].frames, to_uint8(_diffusers(pipe, 3, "np", **kw)))
    steps = {None: 3, 0.9: 5, 0.5: 3}[strength]  # 5 - int(5 - 5 * strength) steps (diffusers get_timesteps)
    assert out.metrics["steps"] == steps


def test_default_size_and_rounding(flux_runtime, make_t2i):
    """Unset sizes are the checkpoint's defaults; others round down to a multiple of 16 with a warning."""
    rt = flux_runtime("dev")
    out = rt.generate(make_t2i(steps=1, height=70, width=50))
    assert out.status is Status.COMPLETED, out.error
    assert out.artifacts["image"].frames.shape == (1, 64, 48, 3)
    assert any("rounded down to 64" in w for w in out.metrics["warnings"])
    out = rt.generate(make_t2i(steps=1))
    assert out.artifacts["image"].frames.shape == (1, 64, 64, 3)  # tiny checkpoint's omniloop.json


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_t2i_bit_exact_in_bfloat16(flux_ckpt, make_t2i, make_manager_flux, to_uint8, variant):
    """The same in bfloat16 on the CPU (every module in bf16, latents in the T5 dtype, as diffusers)."""
    from omniloop import Runtime

    rt = Runtime.from_model(flux_ckpt(variant), device="cpu", dtype="bfloat16", manager=make_manager_flux())
    out = rt.generate(make_t2i(seed=7, steps=3))
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(flux_ckpt(variant), dtype=torch.bfloat16)
    kw = dict(prompt="a red fox jumps over the lazy dog", num_inference_steps=3, height=64, width=64)
    assert out.artifacts["latents"].tensor.dtype == torch.bfloat16
    assert torch.equal(out.artifacts["latents"].tensor, _diffusers(pipe, 7, "latent", **kw))
    assert torch.equal(out.artifacts["image"].frames, to_uint8(_diffusers(pipe, 7, "np", **kw)))


@pytest.mark.parametrize("task", ["t2i", "i2i"])
def test_true_cfg_bit_exact(flux_ckpt, flux_runtime, make_t2i, make_i2i, input_png, to_uint8, task):
    """CFG ``classic`` = diffusers' true CFG: ``negative_prompt`` + ``true_cfg_scale`` (the request's
    guidance scale); the guidance embedding keeps the pipeline's default (3.5 t2i, 7.0 i2i)."""
    if task == "t2i":
        req = make_t2i(seed=7, steps=3)
        pipe = _pipe("FluxPipeline", flux_ckpt("dev"))
        kw = dict(prompt="a red fox jumps over the lazy dog", num_inference_steps=3, height=64, width=64)
    else:
        req = make_i2i(input_png, seed=3, steps=5, height=64, width=64)
        pipe = _pipe("FluxImg2ImgPipeline", flux_ckpt("dev"))
        kw = dict(prompt="a blue cat", image=Image.open(input_png), num_inference_steps=5, height=64, width=64)
    req["inputs"] = [*req.get("inputs", []), {"type": "text", "text": "blurry, low quality", "role": "negative_prompt"}]
    req["diffusion"]["guidance_scale"] = 4.0
    req["node_params"] = {"denoise": {"cfg": "classic"}}
    out = flux_runtime("dev").generate(req)
    assert out.status is Status.COMPLETED, out.error
    assert out.metrics["policies"]["full_steps"] == out.metrics["steps"]  # two forwards every step
    kw.update(negative_prompt="blurry, low quality", true_cfg_scale=4.0)
    assert torch.equal(out.artifacts["latents"].tensor, _diffusers(pipe, req["diffusion"]["seed"], "latent", **kw))
    assert torch.equal(out.artifacts["image"].frames, to_uint8(_diffusers(pipe, req["diffusion"]["seed"], "np", **kw)))
