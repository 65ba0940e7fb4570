"""Moved: the paged KV cache manager is the omniloop-kvcache package (``omniloop_kvcache``) since
omniloop 0.2 (issue 34: the core holds only what every deployment uses)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.kvcache.{name} moved to the omniloop-kvcache package: "
                      f"from omniloop_kvcache import {name} (pip install omniloop-kvcache)")
