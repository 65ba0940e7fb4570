"""Entry point ``profiler`` (group ``omniloop.plugins``): the profiler observer."""

from __future__ import annotations

from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl

from .config import ProfilerConfig

OMNILOOP_HOOK_API = ">=1.0,<2"

NAME = "profiler"


def _make(config: Any) -> Any:
    from .profiler import make_profiler

    return make_profiler(config)


SPEC = PluginComponentSpec(
    name=NAME,
    kind="observer",
    factory=lambda config: _make(config),
    config_schema=ProfilerConfig,
    description="wall/device time per node, step and block; peak memory; torch.profiler window; NVTX",
)


@hookimpl
def omniloop_register_observers(register: Any) -> None:
    register(SPEC)
