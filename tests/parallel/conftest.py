"""Fixtures for the worker-pool tests: one tiny Wan checkpoint per session, built locally."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from omniloop_wan.tiny import build_tiny_checkpoint

#: the workers' plugin manager (a fresh process imports it: Wan + the inline serial scheduler)
MANAGER = "omniloop_parallel.testing:wan_manager"


@pytest.fixture(scope="session")
def wan_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wan-parallel"))


def wan_request(steps: int = 3, seed: int = 3, **diffusion: object) -> dict:
    """A tiny t2v request with CFG on (two branches per step) returning its latents."""
    return {
        "task": "t2v", "prompt": "a red fox in the snow", "negative_prompt": "blurry",
        "diffusion": {"steps": steps, "seed": seed, "frames": 9, "height": 32, "width": 32,
                      "guidance_scale": 5.0, **diffusion},
        "outputs": {"return_latents": True},
    }
