"""Fixtures for the Cosmos 3 family tests: tiny checkpoints (built once per session), runtimes and
diffusers' ``Cosmos3OmniPipeline`` over the same files (safety checker off: it needs
``cosmos_guardrail``).

CPU float32, tiny same-architecture models (``omniloop_cosmos3.tiny``: ``qwen`` — Qwen3 backbone,
fps-modulated mRoPE, Wan 2.2 VAE, sound tokenizer, action head; ``nemotron`` — relu² backbone,
integer mRoPE, Wan 2.1 VAE, native flow schedule), 5 frames of 32x48, 2-3 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import omniloop_cosmos3.plugin as c3_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_cosmos3.tiny import build_tiny_checkpoint

PROMPT = "a red ball rolls over the green grass"
NEGATIVE = "blurry"
SIZE = {"frames": 5, "height": 32, "width": 48}


def c3_runtime(ckpt: Path, *, step: bool = False, **deploy: Any) -> Runtime:
    if step:
        import omniloop_scheduler.plugin as scheduler_plugin

        manager = make_manager(("cosmos3", c3_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
        deploy = {"scheduler": "step", "scheduler_options": {"max_batch": 4}, **deploy}
    else:
        manager = make_manager(("cosmos3", c3_plugin), toy=False)
    return Runtime.from_model(ckpt, manager=manager, **deploy)


def _t2v(seed: int = 0, steps: int = 3, prompt: str = PROMPT, negative: str | None = None, **diffusion: Any
         ) -> dict[str, Any]:
    req: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"seed": seed, "steps": steps, **SIZE,
                                                                           **diffusion},
                           "outputs": {"return_latents": True}}
    if negative is not None:
        req["negative_prompt"] = negative
    return req


@pytest.fixture(scope="session")
def t2v() -> Any:
    return _t2v


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Path] = {}

    def get(variant: str = "qwen") -> Path:
        if variant not in cache:
            cache[variant] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"c3-{variant}"), variant=variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def runtime(tiny_ckpt: Any) -> Any:
    cache: dict[tuple[str, bool], Runtime] = {}

    def get(variant: str = "qwen", step: bool = False) -> Runtime:
        if (variant, step) not in cache:
            cache[(variant, step)] = c3_runtime(tiny_ckpt(variant), step=step)
        return cache[(variant, step)]

    return get


@pytest.fixture(scope="session")
def reference(tiny_ckpt: Any) -> Any:
    """``reference(variant)`` → diffusers' pipeline over the same files, built with the safety checker off."""
    from diffusers import Cosmos3OmniPipeline

    cache: dict[str, Any] = {}

    def get(variant: str = "qwen") -> Any:
        if variant not in cache:
            pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt(variant), enable_safety_checker=False,
                                                       dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            cache[variant] = pipe
        return cache[variant]

    return get
