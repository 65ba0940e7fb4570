"""The request's audio window across families: FamilyCapabilities.audio_tasks / makes_audio, the
core's refusal of ``audio`` where no audio is made, and the toy-audio family (omniloop.testing.toy_audio)
the front ends' tests run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import RequestError
from omniloop.request import Status, TaskType
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import build_toy_audio_checkpoint, build_toy_checkpoint, make_manager
from omniloop.testing.toy_audio import prompt_frequency


@pytest.fixture(scope="module")
def audio_rt(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    ckpt = build_toy_audio_checkpoint(tmp_path_factory.mktemp("ta"), sample_rate=8000, channels=2, max_seconds=4.0)
    return Runtime.from_model(ckpt, manager=make_manager(toy=False, toy_audio=True))


def test_makes_audio_is_t2a_or_declared() -> None:
    assert not FamilyCapabilities().makes_audio(TaskType.T2A)
    caps = FamilyCapabilities(audio=True)
    assert caps.makes_audio(TaskType.T2A) and not caps.makes_audio(TaskType.T2V)
    joint = FamilyCapabilities(audio=True, audio_tasks={TaskType.T2V})
    assert joint.audio_tasks == frozenset({"t2v"}) and joint.makes_audio("t2v") and not joint.makes_audio("t2i")
    # a declaration that contradicts itself or the family's tasks fails registration:
    # tests/core/test_family_contract.py


def test_an_audio_window_where_no_audio_is_made_is_refused_before_compute(tmp_path: Path) -> None:
    ckpt = build_toy_checkpoint(tmp_path / "toy")
    dep = Deployment({"model": {"path": str(ckpt)}}, manager=make_manager())
    with pytest.raises(RequestError) as err:
        dep.check({"task": "t2v", "prompt": "a fox", "audio": {"seconds": 2}})
    assert err.value.path == "audio" and "does not make audio for a t2v request" in err.value.message
    with pytest.raises(RequestError) as err:
        dep.check({"task": "t2a", "prompt": "a fox"})
    assert err.value.path == "task"


def test_toy_audio_makes_a_sine_of_the_prompts_pitch_over_the_window(audio_rt: Runtime) -> None:
    out = audio_rt.generate({"task": "t2a", "prompt": "a flute", "audio": {"seconds": 2.0},
                             "diffusion": {"seed": 1}, "outputs": {"return_latents": True}})
    assert out.status is Status.COMPLETED, out.error
    audio = out.artifacts["audio"]
    assert audio.sample_rate == 8000 and audio.samples.shape == (2, 16000) and audio.samples.dtype == torch.float32
    assert torch.allclose(out.artifacts["latents"].tensor, torch.full((1, 2, 50), 0.5), atol=1e-6)
    x = audio.samples[0].double()
    spec = torch.fft.rfft(x * torch.hann_window(x.shape[0], dtype=torch.float64)).abs()
    assert abs(float(spec.argmax()) * 8000 / x.shape[0] - prompt_frequency("a flute")) < 1.0
    # a window starting later is the same clip's later part (Stable Audio's start/end conditioning)
    late = audio_rt.generate({"task": "t2a", "prompt": "a flute", "audio": {"seconds": 1.0, "start": 1.0},
                              "diffusion": {"seed": 1}}).artifacts["audio"].samples
    assert torch.allclose(late, audio.samples[:, 8000:], atol=1e-5)


def test_toy_audio_guidance_and_negative_prompt_set_the_amplitude(audio_rt: Runtime) -> None:
    out = audio_rt.generate({"task": "t2a", "prompt": "a flute", "negative_prompt": "hiss", "audio": {"seconds": 0.5},
                             "diffusion": {"seed": 1, "guidance_scale": 2.0, "steps": 3},
                             "outputs": {"return_latents": True}})
    assert out.metrics["steps"] == 3
    assert torch.allclose(out.artifacts["latents"].tensor, torch.full((1, 2, 13), 0.75), atol=1e-6)


@pytest.mark.parametrize(("request_part", "path", "message"), [
    ({"audio": {"seconds": 5.0}}, "audio.seconds", "longer than the checkpoint's maximum of 4 s"),
    ({"audio": {"seconds": 2.0, "start": 3.0}}, "audio.seconds", "audio.start + audio.seconds = 5 s"),
    ({"audio": {"start": 4.0}}, "audio.start", "below the checkpoint's maximum"),
    ({"audio": {"seconds": 0}}, "audio.seconds", "must be > 0"),
    ({"audio": {"seconds": float("nan")}}, "audio.seconds", ""),
    ({"diffusion": {"height": 64}}, "diffusion.height", "makes audio"),
    ({"audio": {"enabled": False}}, "audio.enabled", "always makes audio"),
    # the core refuses an action-conditioned request for a family declaring no actions (capabilities.actions)
    ({"action": {"mode": "policy", "chunk_size": 4, "domain": "av"}}, "action", "takes no action-conditioned"),
])
def test_toy_audio_refuses_bad_windows_without_weights(audio_rt: Runtime, request_part: dict[str, Any], path: str,
                                                        message: str) -> None:
    dep = Deployment(audio_rt.deploy, manager=make_manager(toy=False, toy_audio=True))
    with pytest.raises(RequestError) as err:
        dep.check({"task": "t2a", "prompt": "a flute", **request_part})
    assert err.value.path == path and message in err.value.message
