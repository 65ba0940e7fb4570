"""Entry point ``fbcache`` (group ``omniloop.plugins``): registers the first-block cache."""

from __future__ import annotations

from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl

from .config import FBCacheConfig, FBCacheParams

#: the hook-API versions this plugin was written for; outside the range it is refused
OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_interceptors(register: Any) -> None:
    from .interceptor import FirstBlockCache  # on registration: loading this plugin imports no torch (issue 42)

    register(
        PluginComponentSpec(
            name="fbcache",
            kind="block_interceptor",
            factory=lambda config: FirstBlockCache(config),
            config_schema=FBCacheConfig,
            params_schema=FBCacheParams,
            distribution_altering=True,
            description="first-block cache: skip the other blocks while the first block's residual barely changes",
        )
    )
