"""Fixtures for the SD3 family tests: tiny checkpoints (built once per session), runtimes and the
diffusers reference pipelines over the same files.

Everything runs on CPU in float32 with tiny same-architecture models: 32x32 images (4x4 latents,
2x2 patches, 4 image tokens), a 77 + 256 token text context, 2-4 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import omniloop_sd3.plugin as sd3_plugin
from omniloop.testing import make_manager, once_per_arguments
from omniloop_sd3.tiny import build_tiny_checkpoint

PROMPT = "a red fox jumps over the lazy dog"
NEGATIVE = "blurry low quality"


def sd3_manager(*plugins: tuple[str, Any], scheduler: bool = True) -> Any:
    """A plugin manager with only the SD3 family (+ ``plugins``) and the inline serial scheduler."""
    return make_manager(("sd3", sd3_plugin), *plugins, toy=False, scheduler=scheduler)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_ckpt(variant="sd35-medium", t5=True)`` → path of a tiny checkpoint, built once per session."""

    @once_per_arguments
    def get(variant: str = "sd35-medium", t5: bool = True) -> Path:
        return build_tiny_checkpoint(tmp_path_factory.mktemp(f"sd3-{variant}-{t5}"), variant=variant, t5=t5)

    return get


@pytest.fixture(scope="session")
def sd3_runtime(tiny_ckpt):
    """``sd3_runtime(variant="sd35-medium", t5=True)`` → a CPU float32 Runtime (cached)."""
    from omniloop.runtime import Runtime

    @once_per_arguments
    def get(variant: str = "sd35-medium", t5: bool = True) -> Any:
        return Runtime.from_model(tiny_ckpt(variant, t5), manager=sd3_manager())

    return get


@pytest.fixture(scope="session")
def reference(tiny_ckpt):
    """``reference(variant, t5, img2img=False)`` → diffusers' pipeline over the same checkpoint (cached)."""
    from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline

    @once_per_arguments
    def get(variant: str = "sd35-medium", t5: bool = True, img2img: bool = False) -> Any:
        cls = StableDiffusion3Img2ImgPipeline if img2img else StableDiffusion3Pipeline
        extra = {} if t5 else {"text_encoder_3": None, "tokenizer_3": None}
        pipe = cls.from_pretrained(tiny_ckpt(variant, t5), dtype=torch.float32, **extra)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return get


@pytest.fixture(scope="session")
def init_image(noise_png_40x48: Path) -> Path:
    """The i2i input image: ``noise_png_40x48`` (tests/conftest.py)."""
    return noise_png_40x48


def t2i(seed: int = 1, steps: int = 3, prompt: str = PROMPT, negative: str | None = NEGATIVE, **diffusion: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"task": "t2i", "prompt": prompt, "diffusion": {"steps": steps, "seed": seed, **diffusion},
                           "outputs": {"return_latents": True}}
    if negative is not None:
        req["negative_prompt"] = negative
    return req


def i2i(image: Path, strength: float = 0.6, seed: int = 1, steps: int = 4, **kw: Any) -> dict[str, Any]:
    req = t2i(seed=seed, steps=steps, **kw)
    req["task"] = "i2i"
    req["inputs"] = [{"type": "image", "path": str(image)}]
    req["node_params"] = {"denoise": {"strength": strength}}
    return req


@pytest.fixture
def t2i_request():
    return t2i


@pytest.fixture
def i2i_request(init_image):
    return lambda **kw: i2i(init_image, **kw)
