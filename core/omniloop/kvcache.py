"""Moved: the paged KV cache manager is the omniloop-kvcache package since omniloop 0.2 (issue 34:
the core holds only what every deployment uses)."""

from .lazy import moved

__getattr__ = moved(__name__, "omniloop_kvcache")
