"""The execution pool: carries out the policy's plans, one unit at a time, in one thread.

A :class:`Ticket` is one request in the pool. :meth:`StepPool.tick` asks the policy for a plan,
reports its decisions (trace, observer bus, listener), applies cancellations, refusals and
admissions, runs the chosen unit (``Execution.advance`` or ``advance_batch``), measures it for
the cost and memory models, checks loop tensors for NaN when asked, and hands each request's
events to its ``sink``. Nothing here is thread-safe: one thread drives a pool.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from omniloop.execution import Execution, ScheduleDecision, advance_batch
from omniloop.request import EventKind, OmniEvent, OmniOutput

from .errors import AdmissionRefused
from .models import CostModel, MemoryEstimate, MemoryModel, RequestShape, execution_bytes, refine_shape
from .options import SchedulerOptions
from .policy import Plan, StepPolicy

log = logging.getLogger("omniloop.scheduler")

Sink = Callable[[list[OmniEvent]], None]


class Ticket:
    """One request in the pool."""

    __slots__ = (
        "admitted_at",
        "cancel_requested",
        "execution",
        "finished",
        "finished_at",
        "internal",
        "last_unit_at",
        "max_resident",
        "memory",
        "priority",
        "request_id",
        "seq",
        "shape",
        "sink",
        "submitted_at",
    )

    def __init__(
        self, execution: Execution, shape: RequestShape, memory: MemoryEstimate, sink: Sink, seq: int,
        *, internal: bool = False,
    ) -> None:
        self.execution = execution
        self.request_id = execution.request_id
        self.priority = execution.request.priority
        self.seq = seq
        self.shape = shape
        self.memory = memory
        self.sink = sink
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        #: when it last ran a unit (or was admitted): the ``fewest_steps_left`` order's aging
        self.last_unit_at = 0.0
        self.finished_at: float | None = None
        self.cancel_requested = False
        self.max_resident = 0
        self.finished = False
        self.internal = internal

    @property
    def order(self) -> tuple[int, int]:
        return (-self.priority, self.seq)

    def __repr__(self) -> str:
        return f"Ticket({self.request_id}, prio={self.priority}, {self.shape.describe()})"


def release_loops(execution: Execution) -> None:
    """Give back what the loops of a cancelled or failed execution still hold (e.g. KV blocks).

    A loop stage that holds pooled resources across steps may define ``release(state, node)``
    (idempotent); ``finalize`` frees them on completion, this on cancel and failure.
    """
    for node in execution.nodes:
        release = getattr(node.stage, "release", None)
        if callable(release) and node.name in execution.state.loops:
            try:
                release(execution.state, node.name)
            except Exception:
                log.exception("release of node %s failed for %s", node.name, execution.request_id)


def kv_demand(ticket: Ticket) -> tuple[Any, int, bool] | None:
    """(cache pool, blocks, already reserved) of a request whose loop reserves KV blocks at init.

    A loop stage declares it with ``kv_demand(state) -> (pool, blocks) | None``; the pool has
    ``free_blocks``. None when no stage of the request declares one.
    """
    return execution_kv_demand(ticket.execution, ticket.request_id)


def execution_kv_demand(ex: Any, request_id: str = "") -> tuple[Any, int, bool] | None:
    """:func:`kv_demand` of a prepared execution (the server's admission asks it before queueing)."""
    for node in ex.nodes:
        fn = getattr(node.stage, "kv_demand", None)
        if callable(fn):
            try:
                d = fn(ex.state)
            except Exception:
                log.exception("kv_demand failed for %s", request_id or ex.request_id)
                return None
            if d is not None:
                return d[0], int(d[1]), node.name in ex.state.loops
    return None


class PoolListener:
    """Hooks the engine uses for metrics and status (all optional, all called in the pool's thread)."""

    def on_decision(self, decision: ScheduleDecision) -> None: ...

    def on_admit(self, ticket: Ticket) -> None: ...

    def on_unit(self, action: str, tickets: Sequence[Ticket], seconds: float, node: str | None) -> None: ...

    def on_finish(self, ticket: Ticket, output: OmniOutput) -> None: ...


class StepPool:
    def __init__(
        self,
        policy: StepPolicy,
        options: SchedulerOptions,
        cost: CostModel,
        memory: MemoryModel,
        *,
        device: torch.device | None = None,
        listener: PoolListener | None = None,
    ) -> None:
        self.policy = policy
        self.options = options
        self.cost = cost
        self.memory = memory
        self.device = device
        self.listener = listener or PoolListener()
        self.waiting: list[Ticket] = []
        self.running: list[Ticket] = []
        self.trace: deque[ScheduleDecision] = deque(maxlen=options.trace_len)
        self._seq = itertools.count()
        self._by_id: dict[str, Ticket] = {}
        self._cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()

    # -- queue ----------------------------------------------------------------------------------
    def make_ticket(self, execution: Execution, shape: RequestShape, sink: Sink, *, internal: bool = False) -> Ticket:
        return Ticket(execution, shape, self.memory.predict(shape), sink, next(self._seq), internal=internal)

    def check_fits(self, ticket: Ticket) -> None:
        why = self.policy.never_fits(ticket)
        if why is not None:
            raise AdmissionRefused("diffusion", why)

    def submit(self, ticket: Ticket) -> None:
        if ticket.request_id in self._by_id:
            raise ValueError(f"request id {ticket.request_id!r} is already in the pool")
        self._by_id[ticket.request_id] = ticket
        keys = [t.order for t in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, ticket.order), ticket)

    def request_cancel(self, request_id: str) -> bool:
        t = self._by_id.get(request_id)
        if t is None or t.finished:
            return False
        t.cancel_requested = True
        return True

    def cancel_all(self) -> None:
        for t in (*self.running, *self.waiting):
            t.cancel_requested = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    # -- one unit ---------------------------------------------------------------------------------
    def tick(self) -> bool:
        """Decide and run one unit. Returns False when there was nothing to do."""
        if self.idle:
            return False
        plan = self.policy.decide(self.waiting, self.running, self._batch_key)
        for d in plan.decisions:
            self._report(d, plan)
        for t in plan.cancel:
            self._cancel_now(t)
        for t, why in plan.refuse:
            self._refuse(t, why)
        for t in plan.admit:
            if t in self.waiting:
                self.waiting.remove(t)
            t.admitted_at = t.last_unit_at = time.perf_counter()
            self.running.append(t)
            self.listener.on_admit(t)
        for t in plan.dispatch:
            self._dispatch(t)
        if plan.run:
            self._run(plan)
        elif plan.parked and not plan.dispatch:  # every runnable request waits on a remote stage
            self._wait_remote(plan.parked)
        return True

    def _dispatch(self, t: Ticket) -> None:
        """Send ``t``'s next node to the process that runs it (role pools); a failure fails ``t``."""
        node = t.execution.current_node
        try:
            node.stage.dispatch(t.execution)  # type: ignore[union-attr]
        except Exception as exc:
            log.exception("dispatch of %s failed", t.request_id)
            self._deliver(t, t.execution.fail(exc))

    def _wait_remote(self, parked: Sequence[Ticket], seconds: float = 0.05) -> None:
        """Nothing to run here: wait (briefly, so new requests and cancels are seen) for a remote stage."""
        for t in parked:
            node = t.execution.current_node
            stage = getattr(node, "stage", None)
            if stage is not None and callable(getattr(stage, "wait", None)):
                stage.wait(t.request_id, seconds)
                return
        time.sleep(seconds)

    def _batch_key(self, t: Ticket) -> Hashable | None:
        try:
            return t.execution.batch_key()
        except Exception:  # a family's batch_key bug must not stop the pool: run it alone
            log.exception("batch_key failed for %s", t.request_id)
            return None

    def _run(self, plan: Plan) -> None:
        tickets = plan.run
        execs = [t.execution for t in tickets]
        node = execs[0].current_node
        is_loop = node is not None and node.is_loop
        had_loop = all(ex.loop is not None for ex in execs)
        base = self._cuda_begin() if is_loop else None
        t0 = time.perf_counter()
        try:
            results = advance_batch(execs) if len(execs) > 1 else [execs[0].advance()]
        except Exception as exc:  # the core isolates per request; this is a last resort
            log.exception("unit failed outside the execution's isolation")
            results = []
            for ex in execs:
                evs: list[OmniEvent] = []
                if not ex.done:
                    evs.extend(ex.fail(exc))
                results.append(evs)
        seconds = time.perf_counter() - t0
        n = len(tickets)
        for t in tickets:
            t.last_unit_at = t0 + seconds
        if is_loop and self.options.calibrate:
            peak = self._cuda_end(base)
            if had_loop:  # a unit that ran the loop's init is not a typical step
                self.cost.observe(tickets[0].shape, seconds / n, batch=n)
                if peak is not None:
                    self.memory.observe_peak(tickets[0].shape, peak // n)
        self.listener.on_unit(plan.action, tickets, seconds, node.name if node is not None else None)
        for t, evs in zip(tickets, results, strict=True):
            ex = t.execution
            if is_loop and node is not None:
                loop = ex.state.loops.get(node.name)
                if loop is not None and not had_loop:
                    t.shape = refine_shape(t.shape, loop)
                # a batched unit always checks each row: a request whose row turned NaN/inf fails
                # alone with a clear error (its batch-mates' rows are their own math)
                if (self.options.nan_check or n > 1) and not ex.done and loop is not None:
                    self._check_finite(t, node, loop, evs)
            if self.options.calibrate and not ex.done:
                t.max_resident = max(t.max_resident, execution_bytes(ex))
            self._deliver(t, evs)
        done = {id(t) for t in tickets if t.finished}
        run_ids = {id(t) for t in tickets}
        # round-robin: whatever ran goes to the back of the rotation
        self.running = [t for t in self.running if id(t) not in run_ids] + [
            t for t in tickets if id(t) not in done
        ]

    def _check_finite(self, t: Ticket, node: Any, loop: Any, evs: list[OmniEvent]) -> None:
        for name, value in loop.tensors.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                decision = self.policy.nonfinite(t, name, loop.step, node.name)
                self._report(decision, None)
                exc = FloatingPointError(f"non-finite values (NaN/inf) in loop tensor {name!r} after step {loop.step}")
                evs.extend(t.execution.fail(exc))
                return

    def _cancel_now(self, t: Ticket) -> None:
        if t.finished:
            return
        t.execution.cancel()
        evs = t.execution.advance() if not t.execution.done else []
        self._deliver(t, evs)

    def _refuse(self, t: Ticket, why: str) -> None:
        evs: list[OmniEvent] = []
        if not t.execution.done:
            evs.extend(t.execution.fail(AdmissionRefused("diffusion", why)))
        self._deliver(t, evs)

    def _deliver(self, t: Ticket, evs: list[OmniEvent]) -> None:
        final = t.execution.done and not t.finished
        if final and not any(e.kind is EventKind.FINAL for e in evs):
            evs.append(OmniEvent(t.request_id, EventKind.FINAL, output=t.execution.output))
        if final:  # bookkeeping first: whoever sees the final event sees consistent metrics
            self._finish(t)
            try:
                self.listener.on_finish(t, t.execution.output)
            except Exception:
                log.exception("finish listener failed")
        if evs:
            try:
                t.sink(evs)
            except Exception:
                log.exception("event sink of %s failed", t.request_id)

    def _finish(self, t: Ticket) -> None:
        t.finished = True
        t.finished_at = time.perf_counter()
        if t in self.waiting:
            self.waiting.remove(t)
        if t in self.running:
            self.running.remove(t)
        self._by_id.pop(t.request_id, None)
        self.policy.forget(t.request_id)
        out = t.execution.output
        if not out.ok:  # a cancelled or failed loop gives its cache blocks back now, not at GC
            release_loops(t.execution)
            for node in t.execution.nodes:  # and a remote stage forgets a job still in flight
                discard = getattr(node.stage, "discard", None)
                if callable(discard):
                    discard(t.request_id)
        if self.options.calibrate and out.ok and t.max_resident:
            self.memory.observe_resident(t.shape, t.max_resident)

    # -- reporting --------------------------------------------------------------------------------
    def _report(self, d: ScheduleDecision, plan: Plan | None) -> None:
        self.trace.append(d)
        try:
            self.listener.on_decision(d)
        except Exception:
            log.exception("decision listener failed")
        buses = {}
        for rid in d.request_ids:
            t = self._by_id.get(rid)
            bus = t.execution.bus if t is not None else None
            if bus is not None and bus.schedule_decision is not None:
                buses[id(bus)] = bus
        for bus in buses.values():
            try:
                bus.schedule_decision(decision=d)
            except Exception:  # observers are read-only and must not break scheduling
                log.exception("schedule_decision observer failed")

    # -- CUDA peak measurement ----------------------------------------------------------------------
    def _cuda_begin(self) -> int | None:
        if not self._cuda or not self.options.calibrate:
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def _cuda_end(self, base: int | None) -> int | None:
        if base is None:
            return None
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - base)
