"""Moved: component offload is the omniloop-offload package (``omniloop_offload``) since omniloop 0.2
(issue 34); a family's declaration (``OffloadSupport``) is ``omniloop.capabilities``'."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.offload.{name} moved to the omniloop-offload package: "
                      f"from omniloop_offload import {name} (pip install omniloop-offload)")
