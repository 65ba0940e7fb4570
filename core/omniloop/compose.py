"""Moved: composed deployments are the omniloop-compose package (``omniloop_compose``) since omniloop
0.2 (issue 34: the core imports no plugin). ``Runtime.from_deploy`` still loads a ``pipeline:``
deploy, through the runtime loader omniloop-compose registers."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.compose.{name} moved to the omniloop-compose package: "
                      f"from omniloop_compose import {name} (pip install omniloop-compose)")
