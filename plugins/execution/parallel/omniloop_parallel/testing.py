"""Plugin managers for tests and smoke runs, importable by spawned workers (``manager="omniloop_parallel.testing:wan_manager"``)."""

from __future__ import annotations

from typing import Any


def wan_manager() -> Any:
    """Only the Wan family, omniloop-parallel's transports and runtime loader, the inline serial scheduler (no entry-point discovery)."""
    import omniloop_wan.plugin as wan_plugin
    from omniloop.testing import make_manager

    from . import plugin

    return make_manager(("wan", wan_plugin), ("parallel", plugin), toy=False)


def wan_cache_manager() -> Any:
    """:func:`wan_manager` plus the cache-dit block interceptor."""
    import omniloop_cache_dit.plugin as cache_plugin

    pm = wan_manager()
    pm.add("cache-dit", cache_plugin)
    return pm
