"""omniloop-fbcache: a first-block cache, written natively against omniloop's block-interceptor contract."""

from .config import FBCacheConfig, FBCacheParams
from .interceptor import FBCacheState, FirstBlockCache

__all__ = ["FBCacheConfig", "FBCacheParams", "FBCacheState", "FirstBlockCache"]
