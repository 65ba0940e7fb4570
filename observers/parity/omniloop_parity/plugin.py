"""Entry point ``parity`` (group ``omniloop.plugins``): the ParityAligner observer and CLI group."""

from __future__ import annotations

from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl, registering
from omniloop.lazy import lazy_factory

from .config import ParityConfig

OMNILOOP_HOOK_API = ">=1.0,<2"

NAME = "parity"

SPEC = PluginComponentSpec(
    name=NAME, kind="observer", factory=lazy_factory("omniloop_parity.recorder", "ParityRecorder"),
    config_schema=ParityConfig,
    description="record named taps (per step and branch, optional block outputs, final output) to safetensors",
)

omniloop_register_observers = registering(SPEC)


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import parity_group

    cli.add_command(parity_group)
