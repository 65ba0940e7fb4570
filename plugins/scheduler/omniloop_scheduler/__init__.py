"""omniloop schedulers: ``serial`` (request at a time) and ``step`` (interleaved, batched), and the
:class:`AsyncEngine` that serves either from one compute thread."""

from .engine import AsyncEngine, RequestHandle
from .errors import AdmissionRefused, EngineClosed, QueueFull
from .models import CostModel, MemoryModel, RequestShape, shape_of
from .options import SchedulerOptions
from .policy import Plan, SerialPolicy, StepPolicy
from .pool import StepPool, Ticket
from .serial import SerialScheduler
from .step import StepScheduler

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
