"""omniloop-profiler: per node, step and block wall/device time and peak memory.

Enable with ``plugins: {profiler: {...}}`` (see :class:`ProfilerConfig`); read a request's
report with ``runtime.components_enabled["profiler"][1].get_report(request_id)`` and print it
with :func:`summary_table`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("ProfilerConfig",),
    "profiler": ("BlockProfiler", "Profiler", "make_profiler", "write_json"),
    "summary": ("summary_table",),
}

if TYPE_CHECKING:
    from .config import ProfilerConfig
    from .profiler import BlockProfiler, Profiler, make_profiler, write_json
    from .summary import summary_table


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__version__ = "0.1.0"

__all__ = ["BlockProfiler", "Profiler", "ProfilerConfig", "make_profiler", "summary_table", "write_json"]
