"""omniloop schedulers: ``serial`` (request at a time) and ``step`` (interleaved, batched), and the
:class:`AsyncEngine` that serves either from one compute thread."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "engine": ("AsyncEngine", "RequestHandle"),
    "errors": ("AdmissionRefused", "EngineClosed", "QueueFull"),
    "models": ("CostModel", "MemoryModel", "RequestShape", "shape_of"),
    "options": ("SchedulerOptions",),
    "policy": ("Plan", "SerialPolicy", "StepPolicy"),
    "pool": ("StepPool", "Ticket"),
    "serial": ("SerialScheduler",),
    "step": ("StepScheduler",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .engine import AsyncEngine, RequestHandle
    from .errors import AdmissionRefused, EngineClosed, QueueFull
    from .models import CostModel, MemoryModel, RequestShape, shape_of
    from .options import SchedulerOptions
    from .policy import Plan, SerialPolicy, StepPolicy
    from .pool import StepPool, Ticket
    from .serial import SerialScheduler
    from .step import StepScheduler


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}" if module else __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

__all__ = [
    "AdmissionRefused",
    "AsyncEngine",
    "CostModel",
    "EngineClosed",
    "MemoryModel",
    "Plan",
    "QueueFull",
    "RequestHandle",
    "RequestShape",
    "SchedulerOptions",
    "SerialPolicy",
    "SerialScheduler",
    "StepPolicy",
    "StepPool",
    "StepScheduler",
    "Ticket",
    "shape_of",
]
