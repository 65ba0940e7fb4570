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
from omniloop.testing import make_manager
from omniloop_stable_audio.tiny import build_tiny_checkpoint

PROMPT = "a square wave playing three beats per second"
NEGATIVE = "low quality noise"


def sa_manager(*plugins: tuple[str, Any], step: bool = False) -> Any:
    """A plugin manager with only the Stable Audio family (+ ``plugins``); ``step``: the step
    scheduler instead of the inline serial one."""
    if step:
        import omniloop_scheduler.plugin as scheduler_plugin

        return make_manager(("stable-audio", sa_plugin), ("scheduler", scheduler_plugin), *plugins, toy=False,
                            scheduler=False)
    return make_manager(("stable-audio", sa_plugin), *plugins, toy=False)


def sa_runtime(ckpt: Path, *plugins: tuple[str, Any], step: bool = False, **deploy: Any) -> Runtime:
    if step:
        deploy = {"scheduler": "step", "scheduler_options": {"max_batch": 4}, **deploy}
    return Runtime.from_model(ckpt, manager=sa_manager(*plugins, step=step), **deploy)


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


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_ckpt(variant="stereo")`` → path of a tiny checkpoint, built once per session."""
    cache: dict[str, Path] = {}

    def get(variant: str = "stereo") -> Path:
        if variant not in cache:
            cache[variant] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"sa-{variant}"), variant=variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def runtime(tiny_ckpt):
    """``runtime(variant="stereo", step=False)`` → a CPU float32 Runtime (cached)."""
    cache: dict[tuple[str, bool], Runtime] = {}

    def get(variant: str = "stereo", step: bool = False) -> Runtime:
        if (variant, step) not in cache:
            cache[(variant, step)] = sa_runtime(tiny_ckpt(variant), step=step)
        return cache[(variant, step)]

    return get


@pytest.fixture(scope="session")
def reference(tiny_ckpt):
    """``reference(variant)`` → diffusers' ``StableAudioPipeline`` (``StableAudio3Pipeline`` for the
    ``sa3*`` variants) over the same checkpoint (cached)."""
    from diffusers import StableAudio3Pipeline, StableAudioPipeline

    cache: dict[str, Any] = {}

    def get(variant: str = "stereo") -> Any:
        if variant not in cache:
            cls = StableAudio3Pipeline if variant.startswith("sa3") else StableAudioPipeline
            pipe = cls.from_pretrained(tiny_ckpt(variant), dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            cache[variant] = pipe
        return cache[variant]

    return get
