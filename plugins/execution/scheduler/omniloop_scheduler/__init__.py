"""omniloop schedulers: ``serial`` (request at a time) and ``step`` (interleaved, batched), and the
:class:`AsyncEngine` that serves either from one compute thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

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
    "streams": ("EventStream",),
}

if TYPE_CHECKING:
    from .engine import AsyncEngine, RequestHandle
    from .errors import AdmissionRefused, EngineClosed, QueueFull
    from .models import CostModel, MemoryModel, RequestShape, shape_of
    from .options import SchedulerOptions
    from .policy import Plan, SerialPolicy, StepPolicy
    from .pool import StepPool, Ticket
    from .serial import SerialScheduler
    from .step import StepScheduler
    from .streams import EventStream


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "AdmissionRefused",
    "AsyncEngine",
    "CostModel",
    "EngineClosed",
    "EventStream",
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
