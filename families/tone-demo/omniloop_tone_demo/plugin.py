"""omniloop hooks of omniloop-tone-demo: the ``tone-demo`` model preset (family ``stable-audio``)
and ``omniloop eval adherence`` for audio checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import DeployError
from omniloop.family import ModelPreset
from omniloop.hookspecs import hookimpl

from .checkpoint_path import checkpoint_dir, checkpoint_missing

OMNILOOP_HOOK_API = ">=1.0,<2"


def preset_path() -> Path:
    """The ``tone-demo`` folder (built in the cache on first use: :mod:`.checkpoint_path`); one
    clear :class:`DeployError` until its weights are installed or when the cache is not writable."""
    try:
        folder = checkpoint_dir()
    except OSError as e:
        raise DeployError(f"model: preset 'tone-demo': {e}") from None
    why = checkpoint_missing(folder)
    if why is not None:
        raise DeployError(f"model: preset 'tone-demo': {why}")
    return folder


PRESET = ModelPreset(
    name="tone-demo",
    family="stable-audio",
    path=preset_path,
    description="tiny Stable-Audio-architecture t2a model trained on synthetic tones (timbre, pitch, rhythm; "
    "mono 8 kHz, 2.048 s), shipped with omniloop-tone-demo",
)


@hookimpl
def omniloop_register_model_presets(register: Any) -> None:
    register(PRESET)


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import add_to

    add_to(cli)
