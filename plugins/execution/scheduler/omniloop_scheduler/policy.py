"""Every scheduling decision, in one place.

:meth:`StepPolicy.decide` looks at the waiting queue and the running executions and returns a
:class:`Plan`: which cancellations take effect now, which requests are refused, admitted or keep
waiting, and which unit runs next (one stage, one loop step, or one batched loop step). The pool
(:mod:`omniloop_scheduler.pool`) only carries the plan out and reports it.

* **Cancellation first**: a cancel takes effect at the next unit boundary.
* **Admission** in queue order (``request.priority`` high first, then FIFO). The head of the
  queue blocks the ones behind it (no starvation of large requests) — unless ``backfill`` is on:
  then a request behind a head that waits for memory or cost room is admitted when it fits now,
  until the head has waited ``backfill_max_wait_s``; from then on nothing passes it, so the pool
  drains and the head gets in (bounded starvation). A request is admitted when
  the pool's predicted memory (every resident request plus the peaks of the largest batch that
  could run together) stays within the budget, when fewer than ``max_running`` run, and, when
  ``max_round_seconds`` is set, when one round over the running requests stays that short by the
  cost model. A request that could never fit alone is refused (normally already at submit).
* **Step**: round-robin over the running executions, one unit each; the execution at the head
  of the rotation runs, co-batched with every running execution whose ``batch_key()`` equals its
  own (up to ``max_batch``), so a 4-step request is never stuck behind a 50-step one.
* **Order** (``order``): ``round_robin`` by default; ``fewest_steps_left`` gives the next unit to
  the running request closest to done (aging: one idle for ``order_max_wait_s`` goes first).
* **Remote stages** (role pools, omniloop-parallel's ``placement``): a request whose next node runs
  in another process is dispatched there and parked while the others keep stepping; it rejoins
  the rotation at the front when the result is back (the serial policy just waits for it).

``SerialPolicy`` is the request-level FIFO baseline: one request at a time, to completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from attrs import define

from omniloop.execution import ScheduleDecision

from .models import GIB, CostModel, MemoryModel, total_estimate
from .options import SchedulerOptions

if TYPE_CHECKING:
    from .pool import Ticket


@define
class Plan:
    decisions: list[ScheduleDecision] = attrs.Factory(list)
    cancel: list[Ticket] = attrs.Factory(list)
    refuse: list[tuple[Ticket, str]] = attrs.Factory(list)
    admit: list[Ticket] = attrs.Factory(list)
    #: the unit to run now: one ticket, or several sharing a batch key
    run: list[Ticket] = attrs.Factory(list)
    action: str = ""
    #: requests whose next node is a remote stage (role pools) to send to its worker now
    dispatch: list[Ticket] = attrs.Factory(list)
    #: requests waiting for a remote stage to come back (not in the rotation)
    parked: list[Ticket] = attrs.Factory(list)


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


class StepPolicy:
    """Interleaved, batched step scheduling with memory- and cost-aware admission."""

    name = "step"
    interleave = True
    batch = True

    def __init__(
        self, options: SchedulerOptions, cost: CostModel, memory: MemoryModel, budget_bytes: int | None
    ) -> None:
        self.options = options
        self.cost = cost
        self.memory = memory
        self.budget = budget_bytes
        self._waiting_reason: dict[str, str] = {}

    @property
    def max_running(self) -> int:
        return self.options.max_running if self.interleave else 1

    # -- admission ------------------------------------------------------------------------------
    def never_fits(self, ticket: Ticket) -> str | None:
        """Why ``ticket`` could not run even alone, or None."""
        if self.budget is None:
            return None
        need = total_estimate([ticket.memory], self.options.max_batch)
        if need > self.budget:
            return (
                f"needs about {_gib(need)} ({ticket.shape.describe()}: resident {_gib(ticket.memory.resident)}, "
                f"peak {_gib(ticket.memory.peak)}), more than the scheduler's memory budget of {_gib(self.budget)}"
            )
        return None

    def _admission(self, waiting: Sequence[Ticket], running: Sequence[Ticket], plan: Plan) -> None:
        pool = list(running)
        head: Ticket | None = None  # the first request that has to wait
        for t in waiting:
            if t.cancel_requested:
                continue
            why_never = self.never_fits(t)
            if why_never is not None:
                plan.refuse.append((t, why_never))
                plan.decisions.append(self._d("refuse", [t], why_never))
                continue
            reason = self._blocker(t, pool)
            if reason is not None:
                if self._waiting_reason.get(t.request_id) != reason:
                    self._waiting_reason[t.request_id] = reason
                    plan.decisions.append(self._d("wait", [t], reason))
                if head is None:
                    head = t
                if not self._may_backfill(head, pool):
                    break  # head-of-line: the ones behind wait too
                continue
            self._waiting_reason.pop(t.request_id, None)
            pool.append(t)
            plan.admit.append(t)
            used = total_estimate([p.memory for p in pool], self.options.max_batch)
            budget = "unlimited" if self.budget is None else _gib(self.budget)
            behind = f"backfilled behind {head.request_id}; " if head is not None else ""
            plan.decisions.append(self._d(
                "admit", [t],
                f"{behind}{t.shape.describe()}; predicted {self.cost.step_seconds(t.shape):.4g}s/step; "
                f"pool memory {_gib(used)} of {budget}; {len(pool)} running",
            ))

    def _may_backfill(self, head: Ticket, pool: Sequence[Ticket]) -> bool:
        """Whether requests behind a waiting ``head`` may be admitted when they fit."""
        if not self.options.backfill or len(pool) >= self.max_running:
            return False
        return time.perf_counter() - head.submitted_at < self.options.backfill_max_wait_s

    def _blocker(self, t: Ticket, pool: Sequence[Ticket]) -> str | None:
        if len(pool) >= self.max_running:
            return f"{len(pool)} running (max_running {self.max_running})"
        if not pool:
            return None
        if self.budget is not None:
            need = total_estimate([p.memory for p in (*pool, t)], self.options.max_batch)
            if need > self.budget:
                in_use = total_estimate([p.memory for p in pool], self.options.max_batch)
                return (
                    f"memory: would need {_gib(need)} with {len(pool)} running "
                    f"({_gib(in_use)} in use) over the budget of {_gib(self.budget)}"
                )
        kv = self._kv_blocker(t, pool)
        if kv is not None:
            return kv
        limit = self.options.max_round_seconds
        if limit is not None:
            rnd = sum(self.cost.step_seconds(p.shape) for p in (*pool, t))
            if rnd > limit:
                return f"cost: one round would take {rnd:.3g}s predicted, above max_round_seconds {limit}"
        return None

    def _kv_blocker(self, t: Ticket, pool: Sequence[Ticket]) -> str | None:
        """KV-cache room: the request's blocks plus those of admitted requests that have not
        reserved theirs yet must fit in the pool's free blocks (no mid-decode exhaustion)."""
        from .pool import kv_demand

        need = kv_demand(t)
        if need is None:
            return None
        cache, blocks, _ = need
        pending = 0
        for p in pool:
            d = kv_demand(p)
            if d is not None and d[0] is cache and not d[2]:
                pending += d[1]
        free = int(cache.free_blocks) - pending
        if blocks > free:
            return f"kv cache {getattr(cache, 'name', '')!r}: needs {blocks} blocks, {max(0, free)} free"
        return None

    def nonfinite(self, ticket: Ticket, tensor: str, step: int, node: str | None) -> ScheduleDecision:
        """A loop tensor went NaN/inf (``nan_check``): the request fails, the others go on."""
        return self._d("fail", [ticket], f"nan_check: non-finite values in loop tensor {tensor!r} after step {step}", node)

    def forget(self, request_id: str) -> None:
        self._waiting_reason.pop(request_id, None)

    # -- the next unit ---------------------------------------------------------------------------
    def _order(self, running: Sequence[Ticket]) -> tuple[Sequence[Ticket], str]:
        """``order: fewest_steps_left``: the running request with the fewest loop steps left goes
        first (ties: submission order) — unless one has not run for ``order_max_wait_s``, which goes
        first (bounded starvation of long requests). ``round_robin``: the rotation as it is."""
        if not self.interleave or self.options.order != "fewest_steps_left" or len(running) < 2:
            return running, ""
        now = time.perf_counter()
        starved = [t for t in running if now - t.last_unit_at > self.options.order_max_wait_s]
        if starved:
            head = starved[0]
            why = f"; waited over order_max_wait_s {self.options.order_max_wait_s:g}s"
        else:
            head = min(running, key=lambda t: (steps_left(t), t.seq))
            why = f"; fewest steps left ({steps_left(head)})"
        return [head, *(t for t in running if t is not head)], why

    def _next_unit(self, running: Sequence[Ticket], batch_key: Callable[[Ticket], Hashable | None], plan: Plan) -> None:
        if not running:
            return
        running, order_why = self._order(running)
        head = running[0]
        group = [head]
        key = batch_key(head) if self.batch and self.options.max_batch > 1 else None
        if key is not None:
            for t in running[1:]:
                if len(group) >= self.options.max_batch:
                    break
                if not t.cancel_requested and batch_key(t) == key:
                    group.append(t)
        node = head.execution.current_node
        node_name = node.name if node is not None else None
        is_loop = node is not None and node.is_loop
        if len(group) > 1:
            plan.action = "batched_step"
            reason = (
                f"{len(group)} executions share a batch key; predicted "
                f"{self.cost.step_seconds(head.shape, len(group)):.4g}s per member"
            )
        else:
            plan.action = "step" if is_loop else "stage"
            reason = (
                f"round-robin over {len(running)} running" if self.interleave else "serial: run to completion"
            )
            if is_loop:
                reason += f"; predicted {self.cost.step_seconds(head.shape):.4g}s/step"
            reason += order_why
        plan.run = group
        plan.decisions.append(self._d(plan.action, group, reason, node_name))

    def decide(
        self,
        waiting: Sequence[Ticket],
        running: Sequence[Ticket],
        batch_key: Callable[[Ticket], Hashable | None],
    ) -> Plan:
        plan = Plan()
        cancels = [t for t in (*running, *waiting) if t.cancel_requested]
        if cancels:
            plan.cancel = cancels
            for t in cancels:
                plan.decisions.append(self._d("cancel", [t], "cancel requested; takes effect at this step boundary"))
            return plan
        self._admission(waiting, running, plan)
        admitted = {id(t) for t in plan.admit}
        refused = {id(t) for t, _ in plan.refuse}
        rotation = [*running, *(t for t in waiting if id(t) in admitted and id(t) not in refused)]
        if self.interleave:
            rotation = self._remote_stages(rotation, plan)
        self._next_unit(rotation, batch_key, plan)
        return plan

    def _remote_stages(self, rotation: Sequence[Ticket], plan: Plan) -> list[Ticket]:
        """Role pools: a request whose next node runs in another process (``stage.remote``) is
        dispatched to it and parked — out of the rotation, so the others keep stepping — until the
        result is back; then it goes first (collecting is cheap and frees its slot soonest)."""
        back: list[Ticket] = []
        rest: list[Ticket] = []
        for t in rotation:
            stage = remote_stage(t)
            if stage is None:
                rest.append(t)
                continue
            node = t.execution.current_node
            name = node.name if node is not None else None
            if not stage.dispatched(t.request_id):
                plan.dispatch.append(t)
                plan.parked.append(t)
                plan.decisions.append(self._d("dispatch", [t], f"node {name!r} runs in {stage!r}; parked until it is back", name))
            elif stage.ready(t.request_id):
                back.append(t)
            else:
                plan.parked.append(t)
        return [*back, *rest]

    def _d(self, action: str, tickets: Sequence[Ticket], reason: str, node: str | None = None) -> ScheduleDecision:
        return ScheduleDecision(
            scheduler=self.name, action=action, request_ids=tuple(t.request_id for t in tickets), node=node, reason=reason,
        )


def steps_left(ticket: Ticket) -> int:
    """Loop steps ``ticket`` still has to run (its predicted steps minus those done)."""
    return max(0, int(ticket.shape.steps) - int(ticket.execution.steps_done))


def remote_stage(ticket: Ticket) -> Any:
    """The stage of ``ticket``'s next node when it runs in another process (a stage with
    ``remote = True`` and ``dispatch``/``dispatched``/``ready``/``wait``, e.g. omniloop-parallel's
    role pools), else None."""
    ex = ticket.execution
    node = None if ex.done else ex.current_node
    if node is None or node.is_loop:
        return None
    stage = node.stage
    return stage if getattr(stage, "remote", False) is True and callable(getattr(stage, "dispatch", None)) else None


class SerialPolicy(StepPolicy):
    """Request-level FIFO (by priority): one request at a time, to completion, never batched."""

    name = "serial"
    interleave = False
    batch = False


POLICIES: dict[str, type[StepPolicy]] = {"step": StepPolicy, "serial": SerialPolicy}


def make_policy(name: str, *args: Any) -> StepPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(POLICIES)})") from None
    return cls(*args)
