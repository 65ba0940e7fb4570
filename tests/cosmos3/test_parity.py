"""Bit-exact parity with diffusers' ``Cosmos3OmniPipeline`` (CPU float32, ``torch.equal``) on two
tiny checkpoints of different configurations (``qwen``, ``nemotron``: backbone, norms, mRoPE
modulation, VAE, flow schedule all differ), t2v under the runtime-owned loop.

The math is the same op for op — the und pathway computed once instead of every step yields the
same K/V tensors, and the gen pathway attends over them in the same shapes — so nothing but
equality is accepted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omniloop.request import Status

from .conftest import NEGATIVE, PROMPT, SIZE


def _reference(pipe: Any, *, seed: int, steps: int, guidance: float = 6.0, negative: str | None = None,
               output_type: str = "latent") -> Any:
    return pipe(prompt=PROMPT, negative_prompt=negative, num_frames=SIZE["frames"], height=SIZE["height"],
                width=SIZE["width"], num_inference_steps=steps, guidance_scale=guidance,
                generator=torch.Generator().manual_seed(seed), output_type=output_type).video


@pytest.mark.parametrize("variant", ["qwen", "nemotron"])
@pytest.mark.parametrize("guidance", [6.0, 0.5, 1.0])
def test_t2v_latents_bit_exact(runtime, reference, t2v, variant, guidance):
    out = runtime(variant).generate(t2v(seed=3, steps=3, guidance_scale=guidance))
    assert out.status is Status.COMPLETED, out.error
    ref = _reference(reference(variant), seed=3, steps=3, guidance=guidance)
    got = out.artifacts["latents"].tensor
    assert got.shape == ref.shape
    assert torch.equal(got, ref)


@pytest.mark.parametrize("variant", ["qwen", "nemotron"])
def test_t2v_negative_prompt_and_frames_bit_exact(runtime, reference, t2v, variant):
    out = runtime(variant).generate(t2v(seed=5, steps=2, negative=NEGATIVE))
    assert out.status is Status.COMPLETED, out.error
    pipe = reference(variant)
    assert torch.equal(out.artifacts["latents"].tensor, _reference(pipe, seed=5, steps=2, negative=NEGATIVE))
    frames = _reference(pipe, seed=5, steps=2, negative=NEGATIVE, output_type="np")  # [T, H, W, 3] in [0, 1]
    want = torch.from_numpy(np.round(frames * 255).astype(np.uint8))
    video = out.artifacts["video"]
    assert video.frames.shape == (SIZE["frames"], SIZE["height"], SIZE["width"], 3)
    assert torch.equal(video.frames, want)
    assert video.fps == 24.0


@pytest.mark.parametrize("variant", ["qwen", "nemotron"])
def test_one_frame_uses_the_image_templates_bit_exact(runtime, reference, t2v, variant):
    """``diffusion.frames: 1``: the pipeline's text-to-image path (image system prompt and
    resolution sentence, no duration, no fps modulation)."""
    out = runtime(variant).generate(t2v(seed=9, steps=2, frames=1))
    assert out.status is Status.COMPLETED, out.error
    ref = reference(variant)(prompt=PROMPT, num_frames=1, height=SIZE["height"], width=SIZE["width"],
                             num_inference_steps=2, generator=torch.Generator().manual_seed(9),
                             output_type="latent").video
    assert torch.equal(out.artifacts["latents"].tensor, ref)
    assert out.artifacts["video"].frames.shape == (1, SIZE["height"], SIZE["width"], 3)
