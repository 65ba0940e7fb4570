"""The module the entry point names. It holds the hook implementations and the hook-API range.

``OMNILOOP_HOOK_API`` says which versions of omniloop's hook API this plugin was written for; an
omniloop outside the range refuses the plugin with a message saying what it needs (it is then
listed as ``refused`` by ``omniloop plugins`` and never breaks anything else).

Registration hooks only *describe* components: the runtime instantiates them (``factory``) only
when a deploy config enables them by name::

    plugins:
      step-timer: {print_summary: true}
      block-counter: {}
"""

from __future__ import annotations

from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl

from .interceptor import BlockCounter, BlockCounterParams
from .observer import StepTimer, StepTimerConfig

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_observers(register: Any) -> None:
    register(PluginComponentSpec(
        name="step-timer",
        kind="observer",
        factory=StepTimer,  # called with the validated StepTimerConfig
        config_schema=StepTimerConfig,
        description="times every loop step of every request; optional summary on stderr",
    ))


@hookimpl
def omniloop_register_interceptors(register: Any) -> None:
    register(PluginComponentSpec(
        name="block-counter",
        kind="block_interceptor",
        factory=lambda config: BlockCounter(),
        params_schema=BlockCounterParams,  # what a request may tune: plugin_params["block-counter"]
        distribution_altering=False,  # it runs every block unchanged: exact requests keep it
        description="counts transformer block calls per request and guidance branch",
    ))
