"""Moved: the offload test helpers are ``omniloop_offload.testing`` since omniloop 0.2 (issue 34)."""

from ..lazy import moved

__getattr__ = moved(__name__, "omniloop_offload.testing")
