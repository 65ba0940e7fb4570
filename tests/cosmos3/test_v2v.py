"""Video-to-video (task ``v2v``, a video part; the pipeline's ``video`` input): the video resized
to the frame, its first latent frames (0 and 1: the first 5 pixel frames) kept clean, the rest
repeat-padded with the last kept frame and denoised — latents equal diffusers' bit for bit on
both tiny configurations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.errors import RequestError
from omniloop.request import Status

from .conftest import PROMPT


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    from omniloop_io.media import read_video, write_mp4

    frames = torch.from_numpy(np.random.default_rng(4).integers(0, 256, size=(6, 64, 96, 3), dtype=np.uint8))
    path = tmp_path_factory.mktemp("c3-v2v") / "clip.mp4"
    write_mp4(frames, 24.0, path)
    return path, read_video(path)


@pytest.mark.parametrize("variant", ["qwen", "nemotron"])
def test_v2v_bit_exact(runtime, reference, t2v, clip, variant):
    path, frames = clip
    req = {**t2v(seed=3, steps=3, frames=9), "task": "v2v", "inputs": [{"type": "video", "path": str(path)}]}
    out = runtime(variant).generate(req)
    assert out.status is Status.COMPLETED, out.error
    ref = reference(variant)(prompt=PROMPT, video=[Image.fromarray(f.numpy()) for f in frames], num_frames=9,
                             height=32, width=48, num_inference_steps=3, generator=torch.Generator().manual_seed(3),
                             output_type="latent").video
    assert torch.equal(out.artifacts["latents"].tensor, ref)


def test_v2v_refusals(runtime, t2v, clip):
    path, _ = clip
    with pytest.raises(RequestError, match="needs a video part"):
        runtime("qwen").prepare({**t2v(seed=1, steps=1, frames=9), "task": "v2v"})
    for frames in (1, 3):  # 3 frames: one latent frame, so latent frame 1 is not in the clip (diffusers refuses too)
        with pytest.raises(RequestError) as err:
            runtime("qwen").prepare({**t2v(seed=1, steps=1, frames=frames), "task": "v2v",
                                     "inputs": [{"type": "video", "path": str(path)}]})
        assert err.value.path == "diffusion.frames"
