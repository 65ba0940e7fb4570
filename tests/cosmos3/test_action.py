"""Action-conditioned generation (``action: {...}``, diffusers' ``CosmosActionCondition``): the
first frame padded onto the resolution tier's canvas (here 48x80 content on a 192x320 canvas,
replicate padding) and the latents cropped back, the structured JSON caption, domain-aware action
projections; ``policy`` predicts actions (``artifacts["action"]``: ``[chunk, width]`` and the
domain), ``forward_dynamics`` rolls the video out under given actions. Video latents and actions
equal diffusers' bit for bit. Bad action requests are refused before compute, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.errors import RequestError
from omniloop.request import Status

DOMAIN = "bridge_orig_lerobot"  # domain 7, 10 wide (the tiny head is 12 wide, 24 domains)
RAW = [[0.1 * i + 0.01 * j for j in range(10)] for i in range(3)]  # 3 rows for a chunk of 4: the last repeats


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    pixels = np.random.default_rng(3).integers(0, 256, size=(60, 90, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("c3-act") / "frame.png"
    Image.fromarray(pixels).save(path)
    return path, pixels


def _request(path: Path, mode: str, seed: int = 0, **action: Any) -> dict[str, Any]:
    return {"task": "i2v", "prompt": "pick up the cup", "inputs": [{"type": "image", "path": str(path)}],
            "action": {"mode": mode, "chunk_size": 4, "domain": DOMAIN, "resolution_tier": 256, **action},
            "diffusion": {"seed": seed, "steps": 3}, "outputs": {"return_latents": True}}


@pytest.mark.parametrize("mode", ["policy", "forward_dynamics"])
def test_action_modes_bit_exact(runtime, reference, frame, mode):
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    path, pixels = frame
    raw = RAW if mode == "forward_dynamics" else None
    out = runtime("qwen").generate(_request(path, mode, seed=2, **({"raw_actions": raw} if raw else {})))
    assert out.status is Status.COMPLETED, out.error
    cond = CosmosActionCondition(mode=mode, chunk_size=4, domain_name=DOMAIN, resolution_tier=256,
                                 image=Image.fromarray(pixels),
                                 raw_actions=torch.tensor(raw, dtype=torch.float32) if raw else None)
    ref = reference("qwen")(prompt="pick up the cup", action=cond, num_inference_steps=3,
                            generator=torch.Generator().manual_seed(2), output_type="latent")
    assert out.artifacts["latents"].tensor.shape == (1, 48, 2, 3, 5)  # content 48x80 cropped back from the canvas
    assert torch.equal(out.artifacts["latents"].tensor, ref.video)
    if mode == "policy":
        action = out.artifacts["action"]
        assert action.domain == DOMAIN and tuple(action.values.shape) == (4, 10)
        assert torch.equal(action.values, ref.action[0])
    else:
        assert ref.action is None and "action" not in out.artifacts


@pytest.mark.parametrize(("variant", "change", "field", "message"), [
    ("qwen", {"mode": "forward_dynamics"}, "action.raw_actions", "required"),
    ("qwen", {"mode": "inverse_dynamics"}, "task", "off a video"),
    ("qwen", {"domain": "libero"}, "action.domain", "no fixed action width"),
    ("qwen", {"domain": "no_action"}, "action.domain", "no fixed action width"),
    ("qwen", {"domain": "mars_rover"}, "action.domain", "unknown embodiment domain"),
    ("qwen", {"domain": "galbot"}, "action.domain", "30 wide"),
    ("qwen", {"mode": "forward_dynamics", "raw_actions": [[0.0] * 9]}, "action.raw_actions", "9 wide"),
    ("qwen", {"raw_actions": [[0.0] * 10]}, "action.raw_actions", "only forward_dynamics"),
    ("nemotron", {}, "action", "no action head"),
])
def test_bad_action_requests_refused(runtime, frame, variant, change, field, message):
    path, _ = frame
    req = _request(path, "policy")
    req["action"].update(change)
    with pytest.raises(RequestError) as err:
        runtime(variant).prepare(req)
    assert err.value.path == field and message in err.value.message


def test_action_request_needs_an_image(runtime, frame):
    path, _ = frame
    req = _request(path, "policy")
    req["inputs"] = []
    with pytest.raises(RequestError, match="needs an image part"):
        runtime("qwen").prepare(req)
    with pytest.raises(RequestError) as err:
        runtime("qwen").prepare({**_request(path, "policy"), "diffusion": {"frames": 9}})
    assert err.value.path == "diffusion.frames"


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    from omniloop_io.media import read_video, write_mp4

    frames = torch.from_numpy(np.random.default_rng(4).integers(0, 256, size=(6, 64, 96, 3), dtype=np.uint8))
    path = tmp_path_factory.mktemp("c3-vid") / "clip.mp4"
    write_mp4(frames, 24.0, path)
    return path, read_video(path)  # the decoded frames (h264 is lossy): what both sides see


def test_inverse_dynamics_bit_exact(runtime, reference, clip):
    """v2v + ``inverse_dynamics``: every latent video frame clean, the actions between them predicted."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    path, frames = clip
    req = {"task": "v2v", "prompt": "pick up the cup", "inputs": [{"type": "video", "path": str(path)}],
           "action": {"mode": "inverse_dynamics", "chunk_size": 4, "domain": DOMAIN, "resolution_tier": 256},
           "diffusion": {"seed": 5, "steps": 3}, "outputs": {"return_latents": True}}
    out = runtime("qwen").generate(req)
    assert out.status is Status.COMPLETED, out.error
    cond = CosmosActionCondition(mode="inverse_dynamics", chunk_size=4, domain_name=DOMAIN, resolution_tier=256,
                                 video=[Image.fromarray(f.numpy()) for f in frames])
    ref = reference("qwen")(prompt="pick up the cup", action=cond, num_inference_steps=3,
                            generator=torch.Generator().manual_seed(5), output_type="latent")
    assert torch.equal(out.artifacts["latents"].tensor, ref.video)
    assert torch.equal(out.artifacts["action"].values, ref.action[0])


def test_inverse_dynamics_needs_a_video(runtime, frame):
    req = _request(frame[0], "inverse_dynamics")
    req.update(task="v2v", inputs=[])
    with pytest.raises(RequestError, match="needs a video part"):
        runtime("qwen").prepare(req)


def test_policy_with_a_sound_track_bit_exact(runtime, reference, frame):
    """Sound and actions together: the sound frames packed before the action tokens, each stream
    with its own UniPC instance; video latents, actions and waveform all equal diffusers'."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    path, pixels = frame
    out = runtime("qwen").generate({**_request(path, "policy", seed=4), "audio": {"enabled": True}})
    assert out.status is Status.COMPLETED, out.error
    cond = CosmosActionCondition(mode="policy", chunk_size=4, domain_name=DOMAIN, resolution_tier=256,
                                 image=Image.fromarray(pixels))
    ref = reference("qwen")(prompt="pick up the cup", action=cond, enable_sound=True, num_inference_steps=3,
                            generator=torch.Generator().manual_seed(4), output_type="latent")
    assert torch.equal(out.artifacts["latents"].tensor, ref.video)
    assert torch.equal(out.artifacts["action"].values, ref.action[0])
    assert torch.equal(out.artifacts["audio"].samples, ref.sound)
