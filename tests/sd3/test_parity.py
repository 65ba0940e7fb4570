"""Bit-exact parity with diffusers' ``StableDiffusion3Pipeline`` / ``StableDiffusion3Img2ImgPipeline``.

Same tiny checkpoint (loaded by each side from the same files), same seed, CPU float32: the final
latents and the uint8 image are ``torch.equal``. Covers the three transformer architectures (SD3
joint blocks; SD3.5 RMS q/k norm; SD3.5-medium dual-attention layers), a checkpoint without T5
(its context part is zeros), a negative prompt, CFG off (guidance 1), i2i at two strengths, and a
non-default shift and T5 token budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omniloop.request import Status

PROMPT = "a red fox jumps over the lazy dog"  # the conftest request helpers use the same texts
NEGATIVE = "blurry low quality"


def _pixels(pil: Any) -> torch.Tensor:
    return torch.from_numpy(np.asarray(pil).copy())


def _reference(pipe: Any, seed: int, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    lat = pipe(generator=torch.Generator().manual_seed(seed), output_type="latent", **kw).images
    img = pipe(generator=torch.Generator().manual_seed(seed), output_type="pil", **kw).images[0]
    return lat, _pixels(img)


def _assert_equal(out: Any, lat: torch.Tensor, img: torch.Tensor) -> None:
    assert out.status is Status.COMPLETED, out.error
    ours = out.artifacts["latents"].tensor
    assert ours.shape == lat.shape
    assert torch.equal(ours, lat), f"latents differ by {(ours - lat).abs().max().item():.3g}"
    pixels = out.artifacts["image"].pixels
    assert pixels.dtype == torch.uint8 and torch.equal(pixels, img)
    assert torch.equal(out.artifacts["image"].frames, img.unsqueeze(0))


@pytest.mark.parametrize("variant, t5", [("sd3", True), ("sd35", True), ("sd35-medium", True), ("sd35-medium", False)])
def test_t2i_with_negative_prompt_is_bit_exact(sd3_runtime, reference, t2i_request, variant, t5):
    out = sd3_runtime(variant, t5).generate(t2i_request(seed=5, steps=3))
    lat, img = _reference(reference(variant, t5), 5, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3)
    _assert_equal(out, lat, img)


def test_t2i_defaults_cfg_off_shift_and_t5_budget_are_bit_exact(sd3_runtime, reference, t2i_request):
    rt, pipe = sd3_runtime(), reference()
    # no negative prompt (diffusers: ""), guidance off, another shift and T5 budget
    req = t2i_request(seed=2, steps=2, negative=None, guidance_scale=1.0, shift=2.0)
    req["node_params"] = {"text_encode": {"max_sequence_length": 32}}
    out = rt.generate(req)
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=2.0)
    try:
        lat, img = _reference(pipe, 2, prompt=PROMPT, num_inference_steps=2, guidance_scale=1.0, max_sequence_length=32)
    finally:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0)
    _assert_equal(out, lat, img)


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_i2i_is_bit_exact(sd3_runtime, reference, i2i_request, init_image, strength):
    from PIL import Image

    out = sd3_runtime().generate(i2i_request(seed=7, steps=4, strength=strength))
    lat, img = _reference(reference(img2img=True), 7, prompt=PROMPT, negative_prompt=NEGATIVE,
                          image=Image.open(init_image), num_inference_steps=4, strength=strength)
    _assert_equal(out, lat, img)
    assert out.metrics["steps"] == 4 - int(4 - 4 * strength)  # diffusers' get_timesteps
