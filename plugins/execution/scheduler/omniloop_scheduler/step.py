"""The ``step`` scheduler for ``Runtime.generate`` / ``Runtime.stream`` (synchronous).

Every ``stream(execution)`` adds its execution to one shared pool; whichever caller iterates
drives the pool one unit at a time, under a lock, and events are routed to their own stream. Two
streams iterated side by side (or from two threads) therefore interleave and co-batch exactly as
in the :class:`~omniloop_scheduler.engine.AsyncEngine`, which uses the same pool and policy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from omniloop.execution import Execution, ScheduleDecision
from omniloop.request import EventKind, OmniEvent

from .models import GIB, CostModel, MemoryModel, shape_of
from .options import SchedulerOptions, parse_options
from .policy import StepPolicy, make_policy
from .pool import PoolListener, StepPool


def default_budget(options: SchedulerOptions, device: torch.device | None) -> int | None:
    if options.memory_budget_gib is not None:
        return int(options.memory_budget_gib * GIB)
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return None


def build_pool(
    runtime: Any, policy_name: str, options: SchedulerOptions, listener: PoolListener | None = None
) -> StepPool:
    device = getattr(runtime, "device", None)
    cost = CostModel(alpha=options.ema_alpha)
    memory = MemoryModel(alpha=options.ema_alpha, margin=options.memory_margin)
    policy: StepPolicy = make_policy(policy_name, options, cost, memory, default_budget(options, device))
    return StepPool(policy, options, cost, memory, device=device, listener=listener)


class StepScheduler:
    """Interleaved, batched scheduling for the synchronous runtime API."""

    name = "step"
    policy_name = "step"

    def __init__(self, runtime: Any = None, **options: Any) -> None:
        self.runtime = runtime
        self.options = parse_options(options)
        self.pool = build_pool(runtime, self.policy_name, self.options)
        self._lock = threading.RLock()
        # the runtime builds its scheduler before it loads the weights: on CUDA the default
        # budget (a share of free memory) is measured at the first request instead
        self._budget_pending = self.options.memory_budget_gib is None

    @property
    def trace(self) -> list[ScheduleDecision]:
        return list(self.pool.trace)

    def stream(self, execution: Execution) -> Iterator[OmniEvent]:
        buf: deque[OmniEvent] = deque()
        shape = shape_of(self.runtime, execution)
        with self._lock:
            if self._budget_pending:
                self._budget_pending = False
                self.pool.policy.budget = default_budget(self.options, getattr(self.runtime, "device", None))
            ticket = self.pool.make_ticket(execution, shape, buf.extend)
            self.pool.check_fits(ticket)
            self.pool.submit(ticket)
        return self._drive(ticket, buf)

    def drive_once(self) -> bool:
        """One unit of the pool from the caller's thread (``Runtime.update_weights`` finishes the
        requests in flight this way); False when the pool had nothing to run. Events go to their
        streams' buffers as usual."""
        with self._lock:
            return bool(self.pool.tick())

    def _drive(self, ticket: Any, buf: deque[OmniEvent]) -> Iterator[OmniEvent]:
        try:
            while True:
                while buf:
                    ev = buf.popleft()
                    yield ev
                    if ev.kind is EventKind.FINAL:
                        return
                with self._lock:
                    if not buf and not ticket.finished and not self.pool.tick():
                        raise RuntimeError(f"scheduler went idle before request {ticket.request_id} finished")
        finally:
            if not ticket.finished:  # the caller stopped iterating: cancel and release the request
                with self._lock:
                    self.pool.request_cancel(ticket.request_id)
                    for _ in range(10_000):
                        if ticket.finished or not self.pool.tick():
                            break
