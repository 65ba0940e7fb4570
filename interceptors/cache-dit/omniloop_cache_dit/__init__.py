"""omniloop-cache-dit: cache-dit's DBCache / TaylorSeer as an omniloop block interceptor.

``CacheDiTInterceptor`` is imported lazily (it imports cache-dit and diffusers).
"""

from __future__ import annotations

from typing import Any

from .config import CacheDiTConfig, CacheDiTParams

__all__ = ["CacheDiTConfig", "CacheDiTInterceptor", "CacheDiTParams"]


def __getattr__(name: str) -> Any:
    if name == "CacheDiTInterceptor":
        from .interceptor import CacheDiTInterceptor

        return CacheDiTInterceptor
    raise AttributeError(name)
