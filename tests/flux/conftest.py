"""Fixtures for the FLUX.1 family tests: tiny checkpoints (built once per session) and runtimes.

Everything runs on CPU in float32 with tiny same-architecture models (1 double-stream and 2
single-stream blocks, 4 latent channels, T5 context of 32 tokens), 64x64 images (4x4 packed
tokens), 2-6 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import omniloop_flux.plugin as flux_plugin
from omniloop.testing import make_manager, once_per_arguments
from omniloop_flux.tiny import build_tiny_checkpoint

PROMPT = "a red fox jumps over the lazy dog"


def flux_manager(step_scheduler: bool = False) -> Any:
    """Only the FLUX.1 family (+ the inline serial scheduler, + the step scheduler when asked)."""
    plugins: list[tuple[str, Any]] = [("flux", flux_plugin)]
    if step_scheduler:  # the scheduler package's serial and step schedulers, not the inline serial one
        import omniloop_scheduler.plugin as sched_plugin

        plugins.append(("scheduler", sched_plugin))
    return make_manager(*plugins, toy=False, scheduler=not step_scheduler)


@pytest.fixture(scope="session")
def flux_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """``flux_ckpt(variant)`` → path of a tiny checkpoint (``dev`` or ``schnell``), built once per session."""

    @once_per_arguments
    def get(variant: str = "dev") -> Path:
        return build_tiny_checkpoint(tmp_path_factory.mktemp(f"flux-{variant}"), variant=variant)

    return get


@pytest.fixture
def refused_before_load(flux_ckpt, monkeypatch: pytest.MonkeyPatch):
    """``refused(option, [(value, message regex), ...])``: each deploy of the tiny dev checkpoint with
    ``options[option] = value`` (CPU, float32) fails with a ``DeployError`` matching its message before
    any weight is read (the loader is replaced by one that fails the test)."""
    from omniloop.errors import DeployError
    from omniloop.runtime import Runtime
    from omniloop_flux import checkpoint as ck

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ck, "load_component", no_load)

    def refused(option: str, cases: list[tuple[Any, str]]) -> None:
        for value, message in cases:
            with pytest.raises(DeployError, match=message):
                Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager(),
                                   options={option: value})

    return refused


@pytest.fixture(scope="session")
def flux_runtime(flux_ckpt):
    """``flux_runtime(variant, **deploy)`` → a CPU float32 Runtime (cached when no deploy overrides)."""
    from omniloop.runtime import Runtime

    cache: dict[str, Any] = {}

    def get(variant: str = "dev", **deploy: Any) -> Any:
        if not deploy and variant in cache:
            return cache[variant]
        step = deploy.get("scheduler") == "step"
        rt = Runtime.from_model(flux_ckpt(variant), device="cpu", dtype="float32",
                                manager=flux_manager(step_scheduler=step), **deploy)
        if not deploy:
            cache[variant] = rt
        return rt

    return get


@pytest.fixture(scope="session")
def input_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 80x72 RGB noise image (not the output size: i2i resizes it, as diffusers does)."""
    from PIL import Image

    path = tmp_path_factory.mktemp("flux-input") / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 72, 3), dtype=np.uint8)).save(path)
    return path


def t2i(seed: int = 7, steps: int = 3, prompt: str = PROMPT, **diffusion: Any) -> dict[str, Any]:
    return {"task": "t2i", "prompt": prompt, "diffusion": {"steps": steps, "seed": seed, **diffusion},
            "outputs": {"return_latents": True}}


def i2i(image: Path, seed: int = 3, steps: int = 5, prompt: str = "a blue cat", **extra: Any) -> dict[str, Any]:
    req = t2i(seed=seed, steps=steps, prompt=prompt, **extra)
    req["task"] = "i2i"
    req["inputs"] = [{"type": "image", "path": str(image)}]
    return req


def uint8_of(np_images: Any) -> torch.Tensor:
    """diffusers' ``output_type="np"`` images → uint8 the way its PIL conversion rounds them."""
    return torch.from_numpy((np_images * 255).round().astype("uint8"))


@pytest.fixture
def make_t2i():
    return t2i


@pytest.fixture
def make_i2i():
    return i2i


@pytest.fixture
def to_uint8():
    return uint8_of


@pytest.fixture
def make_manager_flux():
    """``make_manager_flux(step_scheduler=False)`` → an isolated manager with the FLUX.1 family."""
    return flux_manager
