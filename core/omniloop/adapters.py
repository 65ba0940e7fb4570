"""Moved: LoRA adapters are the omniloop-adapters package (``omniloop_adapters``) since omniloop 0.2
(issue 34); a family's declaration (``AdapterSupport``) is ``omniloop.capabilities``'."""

from typing import Any

from .capabilities import AdapterFormatError, AdapterSupport, unknown_keys_error  # noqa: F401  (their old home)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"omniloop.adapters.{name} moved to the omniloop-adapters package: "
                      f"from omniloop_adapters import {name} (pip install omniloop-adapters)")
