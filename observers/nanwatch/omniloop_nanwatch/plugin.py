"""Entry point ``nanwatch`` (group ``omniloop.plugins``): the NaN/Inf watch observer."""

from __future__ import annotations

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import registering

from . import NanWatch, NanWatchConfig

OMNILOOP_HOOK_API = ">=1.0,<2"

SPEC = PluginComponentSpec(name="nanwatch", kind="observer", factory=lambda config: NanWatch(config),
                           config_schema=NanWatchConfig,
                           description="stop or flag at the first NaN/Inf in a tap or block output")

omniloop_register_observers = registering(SPEC)
