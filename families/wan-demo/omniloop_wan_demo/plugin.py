"""omniloop hooks of omniloop-wan-demo: the ``wan-demo`` model preset and ``omniloop eval adherence``."""

from __future__ import annotations

from typing import Any

from omniloop.family import ModelPreset
from omniloop.hookspecs import hookimpl

from .checkpoint_path import checkpoint_dir

OMNILOOP_HOOK_API = ">=1.0,<2"

PRESET = ModelPreset(
    name="wan-demo",
    family="wan",
    path=checkpoint_dir,
    description="~3.5 M-param Wan2.1-architecture t2v model trained on synthetic shapes (17x64x64), shipped with omniloop-wan-demo",
    # the demo runs on CPUs: oneDNN VAE convolutions decode ~5x faster there (no clip's color or
    # direction verdict changes; bench/results/cache_demo-*.json); CUDA runs the reference kernels
    options={"vae_cpu_kernels": "fast"},
)


@hookimpl
def omniloop_register_model_presets(register: Any) -> None:
    register(PRESET)


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import add_to

    add_to(cli)
