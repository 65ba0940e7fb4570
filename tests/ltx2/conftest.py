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
from omniloop.testing import make_manager
from omniloop_ltx2.tiny import build_tiny_checkpoint

PROMPT = "a robot dancing in the rain"


def ltx2_manager(*plugins: tuple[str, Any], step: bool = False) -> Any:
    """A plugin manager with only the LTX-2 family (+ ``plugins``); ``step``: the step scheduler."""
    if step:
        import omniloop_scheduler.plugin as scheduler_plugin

        return make_manager(("ltx2", ltx2_plugin), ("scheduler", scheduler_plugin), *plugins, toy=False,
                            scheduler=False)
    return make_manager(("ltx2", ltx2_plugin), *plugins, toy=False)


def ltx2_runtime(ckpt: Path, *plugins: tuple[str, Any], step: bool = False, **deploy: Any) -> Runtime:
    if step:
        deploy = {"scheduler": "step", "scheduler_options": {"max_batch": 4}, **deploy}
    return Runtime.from_model(ckpt, manager=ltx2_manager(*plugins, step=step), **deploy)


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


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``tiny_ckpt(variant="a")`` → path of a tiny checkpoint, built once per session."""
    cache: dict[str, Path] = {}

    def get(variant: str = "a") -> Path:
        if variant not in cache:
            cache[variant] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"ltx2-{variant}"), variant=variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def runtime(tiny_ckpt: Any) -> Any:
    """``runtime(variant="a", step=False)`` → a CPU float32 Runtime (cached)."""
    cache: dict[tuple[str, bool], Runtime] = {}

    def get(variant: str = "a", step: bool = False) -> Runtime:
        if (variant, step) not in cache:
            cache[(variant, step)] = ltx2_runtime(tiny_ckpt(variant), step=step)
        return cache[(variant, step)]

    return get


@pytest.fixture(scope="session")
def reference(tiny_ckpt: Any) -> Any:
    """``reference(variant)`` → diffusers' ``LTX2Pipeline`` over the same checkpoint (cached)."""
    from diffusers import LTX2Pipeline

    cache: dict[str, Any] = {}

    def get(variant: str = "a") -> Any:
        if variant not in cache:
            pipe = LTX2Pipeline.from_pretrained(tiny_ckpt(variant), dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            cache[variant] = pipe
        return cache[variant]

    return get
