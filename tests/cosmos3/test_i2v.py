"""i2v: the image (resized to cover the frame, centre-cropped) repeated over every frame through
the VAE encoder, its first latent frame kept clean, the rest denoised — latents and decoded frames
equal diffusers' ``Cosmos3OmniPipeline(image=...)`` bit for bit, on both tiny configurations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.errors import RequestError
from omniloop.request import Status

from .conftest import PROMPT, SIZE


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, size=(40, 70, 3), dtype=np.uint8)  # another aspect: scaled and cropped
    path = tmp_path_factory.mktemp("c3-img") / "first.png"
    Image.fromarray(pixels).save(path)
    return path, pixels


@pytest.mark.parametrize("variant", ["qwen", "nemotron"])
def test_i2v_bit_exact(runtime, reference, t2v, image_file, variant):
    path, pixels = image_file
    req = {**t2v(seed=6, steps=3), "task": "i2v", "inputs": [{"type": "image", "path": str(path), "role": "image"}]}
    out = runtime(variant).generate(req)
    assert out.status is Status.COMPLETED, out.error
    pipe = reference(variant)
    kw = dict(prompt=PROMPT, image=Image.fromarray(pixels), num_frames=SIZE["frames"], height=SIZE["height"],
              width=SIZE["width"], num_inference_steps=3)
    ref = pipe(**kw, generator=torch.Generator().manual_seed(6), output_type="latent").video
    assert torch.equal(out.artifacts["latents"].tensor, ref)
    frames = pipe(**kw, generator=torch.Generator().manual_seed(6), output_type="np").video
    assert torch.equal(out.artifacts["video"].frames, torch.from_numpy(np.round(frames * 255).astype(np.uint8)))


def test_i2v_without_an_image_refused(runtime, t2v):
    with pytest.raises(RequestError, match="needs an image part"):
        runtime("qwen").prepare({**t2v(seed=1, steps=1), "task": "i2v"})
