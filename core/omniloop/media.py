"""Moved: media I/O is omniloop-io's ``omniloop_io.media`` since omniloop 0.2 (issue 34)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.media.{name} moved to the omniloop-io package: "
                      f"from omniloop_io.media import {name} (pip install omniloop-io)")
