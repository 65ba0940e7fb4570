"""omniloop hooks of omniloop-flux-demo: the ``flux-demo`` model preset (family ``flux``)."""

from __future__ import annotations

from omniloop.family import ModelPreset
from omniloop.hookspecs import registering
from omniloop_kit.presets import preset_folder

from .checkpoint_path import checkpoint_dir, checkpoint_missing

OMNILOOP_HOOK_API = ">=1.0,<2"

#: the ``flux-demo`` folder; one clear :class:`~omniloop.errors.DeployError` until its weights are installed
preset_path = preset_folder("flux-demo", lambda: checkpoint_dir(), lambda: checkpoint_missing())


PRESET = ModelPreset(
    name="flux-demo",
    family="flux",
    path=preset_path,
    description="~4.0 M-param FLUX.1-architecture t2i model (schnell-style, 64x64) trained on coloured shapes "
    "at 9 named positions ('a red star at the top left'), shipped with omniloop-flux-demo",
)


omniloop_register_model_presets = registering(PRESET)
