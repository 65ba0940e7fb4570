"""Fixtures for the Stable Audio family tests: tiny checkpoints (built once per session), runtimes
and diffusers' ``StableAudioPipeline`` over the same files.

Everything runs on CPU in float32 with tiny same-architecture models (``omniloop_stable_audio.tiny``:
``stereo`` — 2 channels at 400 Hz, 0.32 s, linear text projection, GQA; ``mono`` — 1 channel at
256 Hz, 0.375 s, identity projection; Stable Audio 3: ``sa3`` — stereo 256 Hz, differential
attention, memory tokens, stochastic sampling; ``sa3-base`` — mono 200 Hz, DiT patch 2, Euler),
4-5 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("torchsde")

import omniloop_stable_audio.plugin as sa_plugin
from omniloop.runtime import Runtime
from omniloop.testing.pytest_plugin import family_fixtures
from omniloop_scheduler.testing import family_manager, family_runtime
from omniloop_stable_audio.tiny import build_tiny_checkpoint

PROMPT = "a square wave playing three beats per second"
NEGATIVE = "low quality noise"


def sa_manager(*plugins: tuple[str, Any], step: bool = False) -> Any:
    """A plugin manager with only the Stable Audio family (+ ``plugins``); ``step``: the step
    scheduler instead of the inline serial one."""
    return family_manager(("stable-audio", sa_plugin), *plugins, step=step)


def sa_runtime(ckpt: Path, *plugins: tuple[str, Any], step: bool = False, **deploy: Any) -> Runtime:
    return family_runtime(ckpt, ("stable-audio", sa_plugin), *plugins, step=step, **deploy)


def _t2a(seed: int = 0, steps: int = 5, prompt: str = PROMPT, negative: str | None = None, **extra: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"task": "t2a", "prompt": prompt, "diffusion": {"seed": seed, "steps": steps},
                           "outputs": {"return_latents": True}}
    if negative is not None:
        req["negative_prompt"] = negative
    for key, value in extra.items():
        if key in ("guidance_scale", "num_outputs"):
            req["diffusion"][key] = value
        else:
            req[key] = value
    return req


@pytest.fixture(scope="session")
def t2a() -> Any:
    """``t2a(seed, steps, prompt, negative, guidance_scale=..., num_outputs=..., audio=...)`` → a request dict."""
    return _t2a


@pytest.fixture(scope="session")
def make_runtime() -> Any:
    """``make_runtime(ckpt, *plugins, step=False, **deploy)`` → a fresh Runtime (not cached)."""
    return sa_runtime


def _reference(path: Path, variant: str) -> Any:
    from diffusers import StableAudio3Pipeline, StableAudioPipeline

    cls = StableAudio3Pipeline if variant.startswith("sa3") else StableAudioPipeline
    return cls.from_pretrained(path, dtype=torch.float32)


# ``tiny_ckpt(variant="stereo")`` → path of a tiny checkpoint, built once per session;
# ``runtime(variant="stereo", step=False)`` → a CPU float32 Runtime (cached);
# ``reference(variant="stereo")`` → diffusers' ``StableAudioPipeline`` (``StableAudio3Pipeline`` for
# the ``sa3*`` variants) over the same checkpoint (cached).
tiny_ckpt, runtime, reference = family_fixtures(build_tiny_checkpoint, "sa", sa_runtime, _reference, variant="stereo")
