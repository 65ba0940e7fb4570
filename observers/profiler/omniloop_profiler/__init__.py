"""omniloop-profiler: per node, step and block wall/device time and peak memory.

Enable with ``plugins: {profiler: {...}}`` (see :class:`ProfilerConfig`); read a request's
report with ``runtime.components_enabled["profiler"][1].get_report(request_id)`` and print it
with :func:`summary_table`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("ProfilerConfig",),
    "profiler": ("BlockProfiler", "Profiler", "make_profiler", "write_json"),
    "summary": ("summary_table",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .config import ProfilerConfig
    from .profiler import BlockProfiler, Profiler, make_profiler, write_json
    from .summary import summary_table


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}" if module else __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

__version__ = "0.1.0"

__all__ = ["BlockProfiler", "Profiler", "ProfilerConfig", "make_profiler", "summary_table", "write_json"]
