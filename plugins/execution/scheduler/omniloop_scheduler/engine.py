"""The async engine: an asyncio front over one compute thread driving a :class:`StepPool`.

::

    engine = AsyncEngine(runtime, scheduler="step", max_batch=8, memory_budget_gib=40)
    async with engine:                       # start(): worker thread (+ warmup); exit: drain
        h = engine.submit({"task": "t2v", "prompt": "a fox", "diffusion": {"steps": 30}})
        async for ev in h.events(): ...      # progress / partial / error / final
        out = await h.result()
        engine.cancel(h.request_id)          # effective at the next step boundary

``submit`` validates the request completely (``runtime.prepare``), predicts its memory and refuses
it up front if it could never fit (:class:`AdmissionRefused`), or raises :class:`QueueFull` when
``max_queue`` requests wait already. ``await submit_async(request, executor)`` does the same with
the validation in a worker thread (what a server uses: its event loop stays free). All torch work runs in the engine's single worker thread;
events reach asyncio through ``loop.call_soon_threadsafe``. Nothing hangs: a request always ends
with a final event (completed, failed or cancelled), also when the engine shuts down or its
worker dies.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from omniloop.errors import DeployError, RequestError
from omniloop.execution import ScheduleDecision
from omniloop.request import ErrorInfo, EventKind, OmniEvent, OmniOutput, OmniRequest, Status, TaskType
from omniloop.schema import request_from_dict

from .errors import AdmissionRefused, EngineClosed, QueueFull
from .metrics import EngineMetrics
from .models import shape_of
from .options import parse_options
from .pool import PoolListener, StepPool, Ticket
from .step import build_pool
from .streams import EventStream

log = logging.getLogger("omniloop.engine")

#: events kept per request for late subscribers (progress events are small)
MAX_EVENTS = 20_000
#: finished handles kept for ``get()`` (call ``forget()`` to drop one earlier)
MAX_FINISHED_HANDLES = 1000


class RequestHandle(EventStream):
    """A submitted request: its status, progress, events and result. Lives in the event loop."""

    def __init__(self, engine: AsyncEngine, request: OmniRequest, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self.submitted_at = time.time()
        self.status = "queued"  # queued | running | completed | failed | cancelled
        self.step = 0
        self.total = 0
        #: the request's execution (set at submit): cancel() flags it directly
        self._execution: Any = None

    # -- called in the loop thread (through call_soon_threadsafe) ------------------------------
    def _mark_running(self) -> None:
        if self.status == "queued":
            self.status = "running"
            self._notify()

    def _deliver(self, events: Sequence[OmniEvent]) -> None:
        if self.output is not None:
            return
        for ev in events:
            if ev.kind is EventKind.PROGRESS and ev.total:
                self.step, self.total = ev.step or 0, ev.total
            if len(self._events) < MAX_EVENTS or ev.kind in (EventKind.FINAL, EventKind.ERROR):
                self._events.append(ev)
            if ev.kind is EventKind.FINAL and ev.output is not None:
                self.status = ev.output.status.value
                self._finish(ev.output)
        self._notify()

    # -- public -------------------------------------------------------------------------------
    @property
    def progress(self) -> float:
        """0..1: the current loop's step fraction; 1.0 when completed."""
        if self.status == "completed":
            return 1.0
        return min(self.step / self.total, 0.99) if self.total else 0.0

    def cancel(self) -> bool:
        return self.engine.cancel(self.request_id)

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id}, {self.status}, {self.step}/{self.total})"


class _Listener(PoolListener):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def on_decision(self, decision: ScheduleDecision) -> None:
        for cb in self.engine.decision_listeners:
            cb(decision)

    def on_admit(self, ticket: Ticket) -> None:
        if ticket.internal:
            return
        self.engine.metrics.on_admit(time.perf_counter() - ticket.submitted_at)
        h = self.engine._handles.get(ticket.request_id)
        if h is not None:
            self.engine._call(h._mark_running)

    def on_unit(self, action: str, tickets: Sequence[Ticket], seconds: float, node: str | None) -> None:
        if not all(t.internal for t in tickets):
            self.engine.metrics.on_unit(action, len(tickets), seconds)

    def on_finish(self, ticket: Ticket, output: OmniOutput) -> None:
        if ticket.internal:
            return
        self.engine.metrics.on_finish(
            output.status.value, ticket.admitted_at is not None, time.perf_counter() - ticket.submitted_at
        )


class AsyncEngine:
    """Serves requests of one runtime with the ``step`` (interleaved, batched) or ``serial`` policy."""

    def __init__(self, runtime: Any, scheduler: str | None = None, **options: Any) -> None:
        self.runtime = runtime
        deploy = runtime.deploy
        name = scheduler or deploy.scheduler
        if name not in ("step", "serial"):
            raise DeployError(f"scheduler: the async engine runs 'step' or 'serial', not {name!r}")
        self.scheduler = name
        base = dict(deploy.scheduler_options) if deploy.scheduler in ("step", "serial") else {}
        self.options = parse_options({**base, **options})
        self.max_queue = self.options.max_queue or deploy.limits.max_queue
        self.metrics = EngineMetrics()
        self.decision_listeners: list[Any] = []
        self.pool: StepPool = build_pool(runtime, name, self.options, _Listener(self))
        self._handles: dict[str, RequestHandle] = {}
        self._cv = threading.Condition()
        self._inbox: list[Ticket] = []
        self._cancels: list[str] = []
        self._state = "new"  # new | running | draining | stopping | stopped
        self._abort = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.worker_error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        if self._state != "new":
            return self
        self._loop = asyncio.get_running_loop()
        if self.options.warmup:
            await asyncio.to_thread(self._warmup)
        self._state = "running"
        self._thread = threading.Thread(target=self._worker, name="omniloop-engine", daemon=True)
        self._thread.start()
        return self

    async def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; ``drain``: finish what is queued and running, else cancel it all."""
        if self._state in ("stopped", "new") and self._thread is None:
            self._state = "stopped"
            with self._cv:  # submitted before start: cancel them here (no compute runs for that)
                inbox, self._inbox = self._inbox, []
            for t in inbox:
                self.pool.submit(t)
            self.pool.cancel_all()
            for _ in range(len(inbox) + 1):
                if not self.pool.tick():
                    break
            await asyncio.sleep(0)
            self._fail_orphans("the engine was shut down before it started")
            return
        with self._cv:
            self._state = "draining" if drain else "stopping"
            self._abort = not drain
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():  # timed out: cancel the rest, then wait for the boundary
                with self._cv:
                    self._abort = True
                    self._cv.notify_all()
                # as long again at most: a step that does not end is abandoned (a daemon thread),
                # its requests answered as failed below — the caller's bound holds
                await asyncio.to_thread(self._thread.join, 60.0 if timeout is None else timeout)
        self._state = "stopped"
        await asyncio.sleep(0)  # let queued deliveries run
        self._fail_orphans("the engine stopped")

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown(drain=exc[0] is None)

    @property
    def accepting(self) -> bool:
        return self._state in ("new", "running")

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: OmniRequest | Mapping[str, Any]) -> RequestHandle:
        """Validate and queue ``request``; raises RequestError / AdmissionRefused / QueueFull / EngineClosed.

        Validation (``runtime.prepare``: tokenising, image decoding, resolve) runs in the calling
        thread; from a server's event loop use :meth:`submit_async`, which runs it in a worker
        thread so one heavy request never blocks the loop."""
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        req, execution = self._validate(request)
        return self._enqueue(req, execution, loop)

    async def submit_async(self, request: OmniRequest | Mapping[str, Any], executor: Any = None,
                           check: Any = None) -> RequestHandle:
        """:meth:`submit` with the validation in ``executor`` (a ``concurrent.futures`` executor;
        None: asyncio's default), the queueing back on the running loop. ``check(execution)``, run
        after the validation in the same thread, may refuse the prepared request (raise)."""
        loop = asyncio.get_running_loop()
        self._loop = self._loop or loop

        def validate() -> tuple[OmniRequest, Any]:
            req, execution = self._validate(request)
            if check is not None:
                try:
                    check(execution)
                except RequestError:
                    self.metrics.on_reject("invalid")
                    raise
            return req, execution

        req, execution = await loop.run_in_executor(executor, validate)
        return self._enqueue(req, execution, self._loop)

    def _validate(self, request: OmniRequest | Mapping[str, Any]) -> tuple[OmniRequest, Any]:
        """The request parsed and prepared (thread-safe: reads the runtime, queues nothing)."""
        if not self.accepting:
            self.metrics.on_reject("closed")
            raise EngineClosed("the engine is shutting down and takes no new requests")
        try:
            req = request if isinstance(request, OmniRequest) else request_from_dict(request)
            self._check_id(req)
            execution = self.runtime.prepare(req)
        except RequestError:
            self.metrics.on_reject("invalid")
            raise
        return req, execution

    def _check_id(self, req: OmniRequest) -> None:
        h = self._handles.get(req.request_id)
        if h is not None and not h.done():
            raise RequestError("request_id", f"{req.request_id!r} is already queued or running")

    def submit_group(self, request: OmniRequest | Mapping[str, Any]) -> list[RequestHandle]:
        """Validate and queue every sample of a ``diffusion.num_outputs`` group (``Runtime.prepare_group``:
        sample ``i`` has seed ``seed + i`` and id ``<id>_<i>``); all or nothing. The validation runs in
        the calling thread; from an event loop use :meth:`submit_group_async`."""
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        return self._enqueue_group(self._validate_group(request), loop)

    async def submit_group_async(self, request: OmniRequest | Mapping[str, Any],
                                 executor: Any = None) -> list[RequestHandle]:
        """:meth:`submit_group` with the validation in ``executor``, the queueing back on the loop."""
        loop = asyncio.get_running_loop()
        self._loop = self._loop or loop
        executions = await loop.run_in_executor(executor, self._validate_group, request)
        return self._enqueue_group(executions, self._loop)

    def _validate_group(self, request: OmniRequest | Mapping[str, Any]) -> list[Any]:
        if not self.accepting:
            self.metrics.on_reject("closed")
            raise EngineClosed("the engine is shutting down and takes no new requests")
        try:
            req = request if isinstance(request, OmniRequest) else request_from_dict(request)
            executions = self.runtime.prepare_group(req)
            for ex in executions:
                self._check_id(ex.request)
        except RequestError:
            self.metrics.on_reject("invalid")
            raise
        return list(executions)

    def _enqueue_group(self, executions: list[Any], loop: asyncio.AbstractEventLoop) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        try:
            for ex in executions:
                handles.append(self._enqueue(ex.request, ex, loop))
        except BaseException:
            for h in handles:
                self.cancel(h.request_id)
            raise
        return handles

    def _enqueue(self, req: OmniRequest, execution: Any, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        if not self.accepting:  # it began shutting down while the request was prepared
            self.metrics.on_reject("closed")
            raise EngineClosed("the engine is shutting down and takes no new requests")
        try:
            self._check_id(req)  # again: one with the same id may have been queued meanwhile
        except RequestError:
            self.metrics.on_reject("invalid")
            raise
        handle = RequestHandle(self, req, loop)
        handle._execution = execution  # cancel() flags it at once: a running step stops between blocks
        ticket = self.pool.make_ticket(execution, shape_of(self.runtime, execution), self._sink(handle))
        try:
            self.pool.check_fits(ticket)
        except AdmissionRefused:
            self.metrics.on_reject("refused")
            raise
        depth = self.metrics.try_submit(self.max_queue)
        if depth is not None:
            self.metrics.on_reject("queue_full")
            raise QueueFull(depth, self.max_queue)
        with self._cv:
            self._handles[req.request_id] = handle
            self._inbox.append(ticket)
            self._cv.notify_all()
        self._prune_handles()
        return handle

    def _prune_handles(self) -> None:
        """Keep at most ``MAX_FINISHED_HANDLES`` finished handles (and their outputs), oldest dropped."""
        finished = [rid for rid, h in self._handles.items() if h.done()]
        for rid in finished[: max(0, len(finished) - MAX_FINISHED_HANDLES)]:
            del self._handles[rid]

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request: a step that is running stops before its next
        transformer block (omniloop.cancel), else at the next step boundary. False if unknown or done."""
        h = self._handles.get(request_id)
        if h is None or h.done():
            return False
        execution = h._execution
        if execution is not None:
            execution.cancel()  # a flag: safe from this thread; the worker sees it between blocks
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify_all()
        return True

    def get(self, request_id: str) -> RequestHandle | None:
        return self._handles.get(request_id)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's handle (and so its artifacts)."""
        h = self._handles.get(request_id)
        if h is not None and h.done():
            del self._handles[request_id]

    async def generate(self, request: OmniRequest | Mapping[str, Any]) -> OmniOutput:
        return await self.submit(request).result()

    @property
    def trace(self) -> list[ScheduleDecision]:
        """The most recent scheduling decisions (bounded by ``trace_len``)."""
        return list(self.pool.trace)

    def stats(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        snap["scheduler"] = self.scheduler
        snap["max_queue"] = self.max_queue
        snap["memory_budget_bytes"] = self.pool.policy.budget
        return snap

    # -- worker thread -----------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed meanwhile
            pass

    def _sink(self, handle: RequestHandle) -> Any:
        def sink(events: list[OmniEvent]) -> None:
            self._call(handle._deliver, list(events))

        return sink

    def _worker(self) -> None:
        try:
            self._run_worker()
        except BaseException as exc:  # never leave a caller hanging
            log.exception("engine worker died")
            self.worker_error = exc
            self._fail_all(f"engine worker died: {type(exc).__name__}: {exc}")

    def _run_worker(self) -> None:
        pool = self.pool
        while True:
            with self._cv:
                while not self._inbox and not self._cancels and pool.idle and self._state == "running":
                    self._cv.wait(timeout=1.0)
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                abort = self._abort
                if not inbox and not cancels and pool.idle and self._state != "running":
                    return
            for t in inbox:
                pool.submit(t)
            for rid in cancels:
                pool.request_cancel(rid)
            if abort:
                pool.cancel_all()
            try:
                pool.tick()
            except Exception as exc:  # a scheduling bug: fail what is in the pool, keep serving
                log.exception("scheduler tick failed")
                self._fail_pool(f"scheduler error: {type(exc).__name__}: {exc}")

    def _fail_pool(self, message: str) -> None:
        pool = self.pool
        for t in (*pool.running, *pool.waiting):
            evs: list[OmniEvent] = []
            if not t.execution.done:
                evs.extend(t.execution.fail(RuntimeError(message)))
            pool._deliver(t, evs)

    def _fail_all(self, message: str) -> None:
        try:
            self._fail_pool(message)
        except Exception:
            log.exception("failing the pool failed")
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for t in inbox:
            self._call(self._handles[t.request_id]._deliver, [_failed_event(t.request_id, message)])
        self._fail_orphans(message)

    def _fail_orphans(self, message: str) -> None:
        for h in list(self._handles.values()):
            if not h.done():
                self._call(h._deliver, [_failed_event(h.request_id, message)])

    def _warmup(self) -> None:
        """Run one tiny request through the pool (compiles, allocates, calibrates the models)."""
        req = warmup_request(self.runtime)
        execution = self.runtime.prepare(req)
        out: list[OmniOutput] = []

        def sink(events: list[OmniEvent]) -> None:
            out.extend(e.output for e in events if e.output is not None)

        ticket = self.pool.make_ticket(execution, shape_of(self.runtime, execution), sink, internal=True)
        self.pool.submit(ticket)
        for _ in range(100_000):
            if ticket.finished or not self.pool.tick():
                break
        if not out or not out[-1].ok:
            err = out[-1].error if out else None
            raise RuntimeError(f"warmup request failed: {err.message if err else 'no output'}")


def _failed_event(request_id: str, message: str) -> OmniEvent:
    out = OmniOutput(request_id, Status.FAILED, error=ErrorInfo(type="EngineError", message=message))
    return OmniEvent(request_id, EventKind.FINAL, output=out, message=message)


def warmup_request(runtime: Any) -> OmniRequest:
    tasks = {t for t in runtime.family.tasks}
    task = TaskType.T2I if TaskType.T2I in tasks else (TaskType.T2V if TaskType.T2V in tasks else sorted(tasks)[0])
    return request_from_dict({
        "task": task.value, "prompt": "warmup", "diffusion": {"steps": 2, "seed": 0},
        "request_id": "__warmup__", "outputs": {"stream_progress": False},
    })
