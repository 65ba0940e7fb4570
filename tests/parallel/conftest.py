"""Fixtures for the worker-pool tests: one tiny Wan checkpoint per session, built locally."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from omniloop.runtime import Runtime
from omniloop_parallel.testing import wan_manager
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


@pytest.fixture(scope="module")
def reference(wan_ckpt: Path) -> Iterator[Callable[..., Any]]:
    """Single-process outputs, ``reference(**diffusion)`` (cached per module), computed with one
    thread like the workers (CPU BLAS results depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rt = Runtime.from_model(wan_ckpt, manager=wan_manager())
        cache: dict = {}

        def get(**kw: Any) -> Any:
            key = tuple(sorted(kw.items()))
            if key not in cache:
                out = rt.generate(wan_request(**kw))
                assert out.ok, out.error
                cache[key] = out
            return cache[key]

        yield get
    finally:
        torch.set_num_threads(threads)
