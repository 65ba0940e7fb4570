"""Entry point of omniloop-scheduler: registers the ``serial`` and ``step`` schedulers."""

from __future__ import annotations

from typing import Any

from omniloop.family import SchedulerSpec
from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_schedulers(register: Any) -> None:
    from .serial import SerialScheduler  # on registration: loading this plugin imports no torch (issue 42)
    from .step import StepScheduler

    register(SchedulerSpec(name="serial", factory=SerialScheduler, description="one request at a time, to completion"))
    register(SchedulerSpec(
        name="step", factory=StepScheduler,
        description="requests interleaved one step at a time, compatible steps batched, memory-aware admission",
    ))
