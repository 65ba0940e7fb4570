"""omniloop-fbcache: a first-block cache, written natively against omniloop's block-interceptor contract."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("FBCacheConfig", "FBCacheParams"),
    "interceptor": ("FBCacheState", "FirstBlockCache"),
}

if TYPE_CHECKING:
    from .config import FBCacheConfig, FBCacheParams
    from .interceptor import FBCacheState, FirstBlockCache


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["FBCacheConfig", "FBCacheParams", "FBCacheState", "FirstBlockCache"]
