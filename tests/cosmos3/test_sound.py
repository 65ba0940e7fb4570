"""t2v with a sound track (``audio: {"enabled": true}``, diffusers' ``enable_sound``): video
latents, sound latents and the waveform equal diffusers' bit for bit; the waveform is padded to
whole decoder hops like diffusers' (5 frames at 24 fps of 800 Hz = 166 samples → 42 latent frames
of hop 4 → 168 samples, not trimmed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import RequestError
from omniloop.request import Status

from .conftest import PROMPT, SIZE


def _reference(pipe: Any, *, seed: int, steps: int, guidance: float) -> tuple[Any, torch.Tensor]:
    captured: dict[str, torch.Tensor] = {}
    real = pipe.decode_sound

    def capture(latent: torch.Tensor) -> torch.Tensor:
        captured["latents"] = latent.clone()
        return real(latent)

    pipe.decode_sound = capture
    try:
        out = pipe(prompt=PROMPT, num_frames=SIZE["frames"], height=SIZE["height"], width=SIZE["width"],
                   num_inference_steps=steps, guidance_scale=guidance, enable_sound=True,
                   generator=torch.Generator().manual_seed(seed), output_type="latent")
    finally:
        del pipe.decode_sound
    return out, captured["latents"]


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_t2v_with_sound_bit_exact(runtime, reference, t2v, guidance):
    req = {**t2v(seed=4, steps=3, guidance_scale=guidance), "audio": {"enabled": True}}
    out = runtime("qwen").generate(req)
    assert out.status is Status.COMPLETED, out.error
    ref, sound_latents = _reference(reference("qwen"), seed=4, steps=3, guidance=guidance)
    assert torch.equal(out.artifacts["latents"].tensor, ref.video)
    assert torch.equal(out.artifacts["sound_latents"].tensor, sound_latents)
    audio = out.artifacts["audio"]
    assert audio.sample_rate == 800 and tuple(audio.samples.shape) == (2, 168)
    assert torch.equal(audio.samples, ref.sound)


def test_no_sound_unless_asked(runtime, t2v):
    out = runtime("qwen").generate({**t2v(seed=1, steps=1), "audio": {"enabled": False}})
    assert out.status is Status.COMPLETED, out.error
    assert "audio" not in out.artifacts and "sound_latents" not in out.artifacts


def test_sound_refused_without_a_sound_tokenizer(runtime, t2v):
    with pytest.raises(RequestError, match=r"audio\.enabled.*no sound"):
        runtime("nemotron").prepare({**t2v(seed=1, steps=1), "audio": {"enabled": True}})


def test_sound_window_refused(runtime, t2v):
    with pytest.raises(RequestError, match=r"audio\.seconds"):
        runtime("qwen").prepare({**t2v(seed=1, steps=1), "audio": {"enabled": True, "seconds": 1.0}})


def test_i2v_with_sound_bit_exact(runtime, reference, t2v, tmp_path):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(9).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "first.png")
    req = {**t2v(seed=7, steps=2), "task": "i2v", "audio": {"enabled": True},
           "inputs": [{"type": "image", "path": str(tmp_path / "first.png")}]}
    out = runtime("qwen").generate(req)
    assert out.status is Status.COMPLETED, out.error
    ref = reference("qwen")(prompt=PROMPT, image=Image.fromarray(pixels), num_frames=SIZE["frames"],
                            height=SIZE["height"], width=SIZE["width"], num_inference_steps=2, enable_sound=True,
                            generator=torch.Generator().manual_seed(7), output_type="latent")
    assert torch.equal(out.artifacts["latents"].tensor, ref.video)
    assert torch.equal(out.artifacts["audio"].samples, ref.sound)
