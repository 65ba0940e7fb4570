"""An observer: read-only methods named after omniloop's observer events.

Observers are built once per runtime (``factory(config)``) and see every request, so anything
per request is keyed by ``request.request_id`` and dropped at ``omniloop_request_end``. A method
takes only the event arguments it needs (pluggy passes them by name). Events no enabled observer
implements are never called, so implementing few events keeps the step loop cheap.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import attrs

from omniloop.hookspecs import hookimpl


@attrs.define(frozen=True)
class StepTimerConfig:
    """Deploy-time options (``plugins: {step-timer: {...}}``), validated before anything runs."""

    print_summary: bool = False
    #: keep the summaries of this many finished requests on ``StepTimer.finished``
    keep: int = attrs.field(default=100, metadata={"ge": 0})


@attrs.define
class StepTimes:
    node_steps: dict[str, list[float]] = attrs.Factory(dict)
    started: float = 0.0
    total: float = 0.0
    status: str = ""

    @property
    def steps(self) -> int:
        return sum(len(v) for v in self.node_steps.values())


class StepTimer:
    """Times loop steps per request; ``finished[request_id]`` holds the last few summaries."""

    def __init__(self, config: StepTimerConfig | None = None) -> None:
        self.config = config or StepTimerConfig()
        self.running: dict[str, StepTimes] = {}
        self.finished: dict[str, StepTimes] = {}

    @hookimpl
    def omniloop_request_start(self, request: Any) -> None:
        self.running[request.request_id] = StepTimes(started=time.perf_counter())

    @hookimpl
    def omniloop_step_end(self, request: Any, node: str, step: int, seconds: float) -> None:
        times = self.running.get(request.request_id)
        if times is not None:
            times.node_steps.setdefault(node, []).append(seconds)

    @hookimpl
    def omniloop_request_end(self, request: Any, output: Any) -> None:
        times = self.running.pop(request.request_id, None)
        if times is None:
            return
        times.total = time.perf_counter() - times.started
        times.status = output.status.value
        if self.config.keep:
            self.finished[request.request_id] = times
            while len(self.finished) > self.config.keep:
                self.finished.pop(next(iter(self.finished)))
        if self.config.print_summary:
            per_node = ", ".join(
                f"{node}: {len(s)} steps, mean {1000 * sum(s) / len(s):.2f} ms" for node, s in times.node_steps.items() if s
            )
            print(f"[step-timer] {request.request_id} {times.status} in {times.total:.3f} s ({per_node})", file=sys.stderr)
