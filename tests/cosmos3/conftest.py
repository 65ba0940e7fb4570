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
from omniloop.testing.pytest_plugin import family_fixtures
from omniloop_cosmos3.tiny import build_tiny_checkpoint
from omniloop_scheduler.testing import family_runtime

PROMPT = "a red ball rolls over the green grass"
NEGATIVE = "blurry"
SIZE = {"frames": 5, "height": 32, "width": 48}


def c3_runtime(ckpt: Path, *, step: bool = False, **deploy: Any) -> Runtime:
    return family_runtime(ckpt, ("cosmos3", c3_plugin), step=step, **deploy)


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


def _reference(path: Path, variant: str) -> Any:
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.from_pretrained(path, enable_safety_checker=False, dtype=torch.float32)


# ``tiny_ckpt(variant="qwen")`` → path of a tiny checkpoint, built once per session;
# ``runtime(variant="qwen", step=False)`` → a CPU float32 Runtime (cached);
# ``reference(variant="qwen")`` → diffusers' pipeline over the same files, built with the safety
# checker off (cached).
tiny_ckpt, runtime, reference = family_fixtures(build_tiny_checkpoint, "c3", c3_runtime, _reference, variant="qwen")
