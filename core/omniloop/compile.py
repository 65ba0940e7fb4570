"""Moved: regional compilation of a family's blocks is omniloop-kit's ``omniloop_kit.compile``
since omniloop 0.2 (issue 34: the core holds only what every deployment uses)."""

from .lazy import moved

__getattr__ = moved(__name__, "omniloop_kit.compile")
