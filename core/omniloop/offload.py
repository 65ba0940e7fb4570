"""Moved: component offload is the omniloop-offload package since omniloop 0.2 (issue 34); a
family's declaration (``OffloadSupport``) is ``omniloop.capabilities``'."""

from .lazy import moved

__getattr__ = moved(__name__, "omniloop_offload")
