"""Lazy package exports (PEP 562): a plugin package's ``__init__`` names its public names by
defining module and imports each on first use, so plugin discovery (``omniloop --help``, loading
an entry point) imports no torch.

Usage in a package ``__init__``::

    _EXPORTS = {"engine": ("AsyncEngine",), "step": ("StepScheduler",)}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

A module name ``""`` means the package itself. :func:`moved` is the ``__getattr__`` of a module
whose names moved out of the core (issue 34). Imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]], namespace: MutableMapping[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` for ``exports`` (module → names) of ``package``;
    a name is imported once and then cached in ``namespace`` (the package's ``globals()``)."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}" if module else package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *module_of})

    return __getattr__, __dir__


def moved(module: str, homes: str | Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` whose names moved out of the core in omniloop 0.2 (issue
    34): ``homes`` maps each moved name to the module that has it now, or is that module for every
    public name (a module that moved as a whole). Importing a moved name raises one ImportError
    naming its new import and package; any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        home = (None if name.startswith("__") else homes) if isinstance(homes, str) else homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        package = home.split(".")[0].replace("_", "-")
        raise ImportError(f"{module}.{name} moved to {package} (omniloop 0.2, issue 34): "
                          f"from {home} import {name} (pip install {package})")

    return __getattr__


def lazy_factory(module: str, name: str) -> Callable[[Any], Any]:
    """A plugin component factory ``config -> component`` that imports ``module`` (and calls its
    ``name``) on first use, so registering the component imports nothing heavy."""

    def factory(config: Any) -> Any:
        return getattr(importlib.import_module(module), name)(config)

    return factory


__all__ = ["lazy_exports", "lazy_factory", "moved"]
