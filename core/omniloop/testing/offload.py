"""Moved: the offload test helpers are ``omniloop_offload.testing`` since omniloop 0.2 (issue 34)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.testing.offload.{name} moved: from omniloop_offload.testing import {name}")
