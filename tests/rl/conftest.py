"""Fixtures for the post-training tests (omniloop.rl, Runtime.update_weights / sleep / wake):
tiny Wan, FLUX.1 and SD3 checkpoints (built once per session) and CPU float32 runtimes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from omniloop.testing import make_manager

PROMPT = "a red fox jumps over the lazy dog"


def manager(family: str, step: bool = False, *extra: tuple[str, Any]) -> Any:
    import importlib

    import omniloop_adapters.plugin as adapters_plugin  # update_weights(..., adapter=NAME)
    import omniloop_rl.plugin as rl_plugin  # update_weights, weights_checksum

    plugin = importlib.import_module(f"omniloop_{family}.plugin")
    plugins: list[tuple[str, Any]] = [(family, plugin), ("adapters", adapters_plugin), ("rl", rl_plugin), *extra]
    if step:
        import omniloop_scheduler.plugin as sched_plugin

        plugins.append(("scheduler", sched_plugin))
    return make_manager(*plugins, toy=False, scheduler=not step)


@pytest.fixture(scope="session")
def rl_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """``rl_ckpt(family)`` → a tiny checkpoint path (flow-matching Euler scheduler for Wan)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            out = tmp_path_factory.mktemp(f"rl-{family}")
            if family == "wan":
                from omniloop_wan.tiny import build_tiny_checkpoint as build_wan

                cache[family] = build_wan(out, variant="t2v", scheduler="flow_euler")
            elif family == "flux":
                from omniloop_flux.tiny import build_tiny_checkpoint as build_flux

                cache[family] = build_flux(out, variant="dev")
            else:
                from omniloop_sd3.tiny import build_tiny_checkpoint as build_sd3

                cache[family] = build_sd3(out)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def rl_runtime(rl_ckpt):
    """``rl_runtime(family, step=False, **deploy)`` → a CPU float32 Runtime (cached without overrides)."""
    from omniloop.runtime import Runtime

    cache: dict[str, Any] = {}

    def get(family: str, step: bool = False, extra: tuple[tuple[str, Any], ...] = (), **deploy: Any) -> Any:
        if step:
            deploy["scheduler"] = "step"
        if deploy or extra:
            return Runtime.from_model(str(rl_ckpt(family)), manager=manager(family, step, *extra), **deploy)
        if family not in cache:
            cache[family] = Runtime.from_model(str(rl_ckpt(family)), manager=manager(family))
        return cache[family]

    return get


def request(family: str, seed: int = 3, steps: int = 4, rollout: dict[str, Any] | None = None,
            **diffusion: Any) -> dict[str, Any]:
    """A small request of ``family``'s task (Wan: 5 frames of 32x32; images 64x64)."""
    task = "t2v" if family == "wan" else "t2i"
    size = {"height": 32, "width": 32, "frames": 5} if family == "wan" else {"height": 64, "width": 64}
    req: dict[str, Any] = {"task": task, "prompt": PROMPT,
                           "diffusion": {"steps": steps, "seed": seed, **size, **diffusion},
                           "outputs": {"return_latents": True}}
    if rollout is not None:
        req["rollout"] = rollout
    return req


@pytest.fixture
def make_request():
    return request


@pytest.fixture
def fresh_runtime():
    """``fresh_runtime(path, family="flux", step=False, **deploy)`` → a new Runtime (never cached:
    for tests that change its weights)."""
    from omniloop.runtime import Runtime

    def get(path: Path, family: str = "flux", step: bool = False, **deploy: Any) -> Any:
        if step:
            deploy["scheduler"] = "step"
        return Runtime.from_model(str(path), manager=manager(family, step), **deploy)

    return get
