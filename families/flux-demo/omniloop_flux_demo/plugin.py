"""omniloop hooks of omniloop-flux-demo: the ``flux-demo`` model preset (family ``flux``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import DeployError
from omniloop.family import ModelPreset
from omniloop.hookspecs import hookimpl

from .checkpoint_path import checkpoint_dir, checkpoint_missing

OMNILOOP_HOOK_API = ">=1.0,<2"


def preset_path() -> Path:
    """The ``flux-demo`` folder; one clear :class:`DeployError` until its weights are installed."""
    why = checkpoint_missing()
    if why is not None:
        raise DeployError(f"model: preset 'flux-demo': {why}")
    return checkpoint_dir()


PRESET = ModelPreset(
    name="flux-demo",
    family="flux",
    path=preset_path,
    description="~4.0 M-param FLUX.1-architecture t2i model (schnell-style, 64x64) trained on coloured shapes "
    "at 9 named positions ('a red star at the top left'), shipped with omniloop-flux-demo",
)


@hookimpl
def omniloop_register_model_presets(register: Any) -> None:
    register(PRESET)
