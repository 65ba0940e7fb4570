"""Entry point ``cache-dit`` (group ``omniloop.plugins``): registers the block interceptor.

Registration is light: cache-dit (and diffusers) are imported only when a deploy enables the
interceptor and the runtime calls the factory.
"""

from __future__ import annotations

from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import registering

from .config import CacheDiTConfig, CacheDiTParams

OMNILOOP_HOOK_API = ">=1.0,<2"

NAME = "cache-dit"


def make_interceptor(config: Any) -> Any:
    from .interceptor import CacheDiTInterceptor

    return CacheDiTInterceptor(config)


SPEC = PluginComponentSpec(
    name=NAME, kind="block_interceptor", factory=make_interceptor, config_schema=CacheDiTConfig,
    params_schema=CacheDiTParams, distribution_altering=True,
    description="cache-dit DBCache (Fn/Bn dual block cache) with optional TaylorSeer, per request and branch",
)

omniloop_register_interceptors = registering(SPEC)
