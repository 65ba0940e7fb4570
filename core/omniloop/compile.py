"""Moved: regional compilation of a family's blocks is omniloop-kit's ``omniloop_kit.compile`` since
omniloop 0.2 (issue 34: the core holds only what every deployment uses)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.compile.{name} moved to omniloop-kit: from omniloop_kit.compile import {name}")
