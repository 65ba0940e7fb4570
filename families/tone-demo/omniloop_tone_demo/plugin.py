"""omniloop hooks of omniloop-tone-demo: the ``tone-demo`` model preset (family ``stable-audio``)
and ``omniloop eval adherence`` for audio checkpoints."""

from __future__ import annotations

from typing import Any

from omniloop.family import ModelPreset
from omniloop.hookspecs import hookimpl, registering
from omniloop_kit.presets import preset_folder

from .checkpoint_path import checkpoint_dir, checkpoint_missing

OMNILOOP_HOOK_API = ">=1.0,<2"


#: the ``tone-demo`` folder (built in the cache on first use: :mod:`.checkpoint_path`); one clear
#: :class:`~omniloop.errors.DeployError` until its weights are installed or when the cache is not writable
preset_path = preset_folder("tone-demo", lambda: checkpoint_dir(), lambda folder: checkpoint_missing(folder), built=True)


PRESET = ModelPreset(
    name="tone-demo",
    family="stable-audio",
    path=preset_path,
    description="tiny Stable-Audio-architecture t2a model trained on synthetic tones (timbre, pitch, rhythm; "
    "mono 8 kHz, 2.048 s), shipped with omniloop-tone-demo",
)


omniloop_register_model_presets = registering(PRESET)


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import add_to

    add_to(cli)
