"""omniloop.hookspecs.registering: a plugin module's registration hook that only registers its specs."""

from __future__ import annotations

import types

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import registering
from omniloop.testing import make_manager


class _Watch:
    name = "watch"

    def __init__(self, config: object) -> None:
        self.config = config


def test_a_module_whose_hook_is_registering_registers_its_spec() -> None:
    spec = PluginComponentSpec(name="watch", kind="observer", factory=lambda config: _Watch(config))
    module = types.ModuleType("watch_plugin")
    module.OMNILOOP_HOOK_API = ">=1.0,<2"  # type: ignore[attr-defined]
    module.omniloop_register_observers = registering(spec)  # type: ignore[attr-defined]
    got: list[object] = []
    module.omniloop_register_observers(got.append)
    assert got == [spec]
    pm = make_manager(("watch", module))
    assert pm.registry().component("watch") is spec
