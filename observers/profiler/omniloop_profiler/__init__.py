"""omniloop-profiler: per node, step and block wall/device time and peak memory.

Enable with ``plugins: {profiler: {...}}`` (see :class:`ProfilerConfig`); read a request's
report with ``runtime.components_enabled["profiler"][1].get_report(request_id)`` and print it
with :func:`summary_table`.
"""

from __future__ import annotations

from .config import ProfilerConfig
from .profiler import BlockProfiler, Profiler, make_profiler, write_json
from .summary import summary_table

__version__ = "0.1.0"

__all__ = ["BlockProfiler", "Profiler", "ProfilerConfig", "make_profiler", "summary_table", "write_json"]
