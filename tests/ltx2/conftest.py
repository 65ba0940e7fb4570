"""Fixtures for the LTX-2 family tests: tiny checkpoints (built once per session), runtimes and
diffusers' ``LTX2Pipeline`` over the same files.

Everything runs on CPU in float32 with tiny same-architecture models (``omniloop_ltx2.tiny``:
``a`` — video VAE 2x/2x, stereo vocoder, perturbed attention on block 1; ``b`` — VAE 4x/4x, mono
vocoder, no perturbed attention, three layers), 32x32 pixels, 2 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import omniloop_ltx2.plugin as ltx2_plugin
from omniloop.runtime import Runtime
from omniloop.testing.pytest_plugin import family_fixtures
from omniloop_ltx2.tiny import build_tiny_checkpoint
from omniloop_scheduler.testing import family_manager, family_runtime

PROMPT = "a robot dancing in the rain"


def ltx2_manager(*plugins: tuple[str, Any], step: bool = False) -> Any:
    """A plugin manager with only the LTX-2 family (+ ``plugins``); ``step``: the step scheduler."""
    return family_manager(("ltx2", ltx2_plugin), *plugins, step=step)


def ltx2_runtime(ckpt: Path, *plugins: tuple[str, Any], step: bool = False, **deploy: Any) -> Runtime:
    return family_runtime(ckpt, ("ltx2", ltx2_plugin), *plugins, step=step, **deploy)


def _t2v(seed: int = 0, frames: int = 5, prompt: str = PROMPT, negative: str | None = None, **extra: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"seed": seed, "frames": frames},
                           "outputs": {"return_latents": True}}
    if negative is not None:
        req["negative_prompt"] = negative
    for key, value in extra.items():
        if key in ("guidance_scale", "fps", "steps", "height", "width"):
            req["diffusion"][key] = value
        else:
            req[key] = value
    return req


@pytest.fixture(scope="session")
def t2v() -> Any:
    """``t2v(seed, frames, prompt, negative, fps=..., guidance_scale=..., audio=..., node_params=...)`` → a request dict."""
    return _t2v


@pytest.fixture(scope="session")
def manager() -> Any:
    """``manager(*plugins, step=False)`` → a plugin manager with the LTX-2 family (the CLI's ``obj``)."""
    return ltx2_manager


@pytest.fixture(scope="session")
def make_runtime() -> Any:
    """``make_runtime(ckpt, *plugins, step=False, **deploy)`` → a fresh Runtime (not cached)."""
    return ltx2_runtime


def _reference(path: Path, variant: str) -> Any:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(path, dtype=torch.float32)


# ``tiny_ckpt(variant="a")`` → path of a tiny checkpoint, built once per session;
# ``runtime(variant="a", step=False)`` → a CPU float32 Runtime (cached);
# ``reference(variant="a")`` → diffusers' ``LTX2Pipeline`` over the same checkpoint (cached).
tiny_ckpt, runtime, reference = family_fixtures(build_tiny_checkpoint, "ltx2", ltx2_runtime, _reference, variant="a")
