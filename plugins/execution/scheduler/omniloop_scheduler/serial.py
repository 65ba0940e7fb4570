"""The ``serial`` scheduler: one request at a time, to completion, in the caller's thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omniloop.execution import Execution, ScheduleDecision
from omniloop.request import OmniEvent

from .pool import release_loops


class SerialScheduler:
    """Runs each execution node by node, loop step by loop step, yielding its events as they happen."""

    name = "serial"

    def __init__(self, runtime: Any = None, **options: Any) -> None:
        # the options are the async engine's (queue, memory budget, warmup): validated, unused here
        from .options import parse_options

        self.options = parse_options(options)
        self.runtime = runtime

    def stream(self, execution: Execution) -> Iterator[OmniEvent]:
        bus = execution.bus
        if bus is not None and bus.schedule_decision is not None:
            bus.schedule_decision(decision=ScheduleDecision(
                scheduler=self.name, action="admit", request_ids=(execution.request_id,), reason="serial: run to completion",
            ))
        try:
            while not execution.done:
                yield from execution.advance()
        finally:
            if execution.done and not execution.output.ok:
                release_loops(execution)
