"""A family package's lazy exports: importing the package must not import torch or diffusers."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names[attr]`` (a submodule, ``.family``) of
    ``package`` on first access and returns its ``attr``."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(name)
        return getattr(importlib.import_module(module, package), name)

    return __getattr__


__all__ = ["lazy_exports"]
