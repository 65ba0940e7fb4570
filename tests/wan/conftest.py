"""Fixtures for the Wan family tests: tiny checkpoints (built once per session) and runtimes.

Everything runs on CPU in float32 with tiny same-architecture models: 9 frames at 32x32
(3 latent frames of 4x4, 2x2 patches), 2-4 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import omniloop_wan.plugin as wan_plugin
from omniloop.loop import StepContext
from omniloop.testing import PassThroughSteps, component_plugin, make_manager
from omniloop_wan.tiny import build_tiny_checkpoint


def wan_manager() -> Any:
    """A plugin manager with only the Wan family and the inline serial scheduler (no discovery)."""
    return make_manager(("wan", wan_plugin), toy=False)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_ckpt(variant, scheduler="unipc")`` → path of a tiny checkpoint, built once per session."""
    cache: dict[tuple[str, str], Path] = {}

    def get(variant: str = "t2v", scheduler: str = "unipc") -> Path:
        key = (variant, scheduler)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{variant}-{scheduler}")
            cache[key] = build_tiny_checkpoint(out, variant=variant, scheduler=scheduler)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def wan_runtime(tiny_ckpt):
    """``wan_runtime(variant, scheduler="unipc", **deploy)`` → a CPU float32 Runtime (cached without deploy overrides)."""
    from omniloop.runtime import Runtime

    cache: dict[tuple[str, str], Any] = {}

    def get(variant: str = "t2v", scheduler: str = "unipc", **deploy: Any) -> Any:
        key = (variant, scheduler)
        if deploy:
            return Runtime.from_model(tiny_ckpt(variant, scheduler), manager=wan_manager(), **deploy)
        if key not in cache:
            cache[key] = Runtime.from_model(tiny_ckpt(variant, scheduler), manager=wan_manager())
        return cache[key]

    return get


class CountingInterceptor(PassThroughSteps):
    """A pass-through step interceptor recording (step, forward name, batch rows)."""

    name = "count"

    def __init__(self, log: list) -> None:
        self.log = log

    def open(self, step: StepContext, loop: Any, params: Any = None) -> Any:
        return step.branch

    def forward(self, step: StepContext, state: Any, inputs: dict[str, Any], compute: Any) -> torch.Tensor:
        assert state == step.branch  # per-forward-name state
        self.log.append((step.step_index, step.branch, int(inputs["hidden_states"].shape[0])))
        return compute()


@pytest.fixture(scope="session")
def counting(tiny_ckpt):
    """``counting(variant)`` → (runtime with the counting interceptor, its log)."""
    cache: dict[str, Any] = {}

    def get(variant: str = "t2v") -> tuple[Any, list]:
        if variant not in cache:
            log: list = []
            manager = wan_manager()
            manager.add("count", component_plugin("count", "step_interceptor", lambda log=log: CountingInterceptor(log)))
            from omniloop.runtime import Runtime

            cache[variant] = (Runtime.from_model(tiny_ckpt(variant), manager=manager, plugins={"count": {}}), log)
        rt, log = cache[variant]
        log.clear()
        return rt, log

    return get


@pytest.fixture(scope="session")
def image_file(noise_png_40x48: Path) -> Path:
    """The I2V conditioning image: ``noise_png_40x48`` (tests/conftest.py; the I2V path resizes it)."""
    return noise_png_40x48


def _t2v_request(**diffusion: Any) -> dict[str, Any]:
    d = {"steps": 3, "guidance_scale": 5.0, "seed": 7, "height": 32, "width": 32, "frames": 9}
    d.update(diffusion)
    return {
        "task": "t2v",
        "inputs": [{"type": "text", "text": "a red fox jumps over the lazy dog"},
                   {"type": "text", "text": "blurry, low quality", "role": "negative_prompt"}],
        "diffusion": d,
        "outputs": {"return_latents": True},
    }


def _i2v_request(image: Path, **diffusion: Any) -> dict[str, Any]:
    req = _t2v_request(**diffusion)
    req["task"] = "i2v"
    req["inputs"].append({"type": "image", "path": str(image)})
    return req


@pytest.fixture
def t2v_request():
    """``t2v_request(**diffusion)`` → a request dict (3 steps, CFG 5, seed 7, 9x32x32, latents returned)."""
    return _t2v_request


@pytest.fixture
def i2v_request(image_file: Path):
    """``i2v_request(**diffusion)`` → the same request as i2v with the session's conditioning image."""
    return lambda **d: _i2v_request(image_file, **d)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models: one intra-op thread. With two, OpenMP spin-waiting on a loaded 2-core machine made
    these tests 5-10x slower (100 s vs 13 s for the parity module). Parity compares within one
    process, so the thread count does not affect what is compared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
