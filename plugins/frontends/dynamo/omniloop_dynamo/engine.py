"""The engine the worker submits to, and the per-request cost estimate.

The worker serves omniloop's ``AsyncEngine`` (``omniloop_scheduler``): ``submit(request) ->
handle``, ``await handle.result()``, ``async for ev in handle.events()``, ``cancel(request_id)``,
``start()`` / ``shutdown(drain=, timeout=)``, ``stats()``. :class:`ThreadEngine` is a thin
stand-in with the same surface that drives ``runtime.prepare`` + the deploy's scheduler in one
thread; it is used only when ``omniloop_scheduler.AsyncEngine`` cannot be imported.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from omniloop.request import ErrorInfo, EventKind, OmniEvent, OmniOutput, OmniRequest, Status
from omniloop.schema import request_from_dict
from omniloop_scheduler.streams import EventStream

log = logging.getLogger("omniloop.dynamo")


class EngineClosedError(Exception):
    """The fallback engine takes no new requests (it is draining or stopped)."""


def make_engine(runtime: Any, scheduler: str | None = None, **options: Any) -> Any:
    """``AsyncEngine(runtime, scheduler=...)`` when omniloop-scheduler has it, else :class:`ThreadEngine`."""
    try:
        from omniloop_scheduler import AsyncEngine
    except ImportError:
        log.warning("omniloop_scheduler.AsyncEngine is not available; using the one-request-at-a-time fallback")
        return ThreadEngine(runtime)
    if scheduler is None:
        scheduler = runtime.deploy.scheduler if runtime.deploy.scheduler in ("step", "serial") else "step"
    return AsyncEngine(runtime, scheduler=scheduler, **options)


def closed_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [EngineClosedError]
    try:
        from omniloop_scheduler import EngineClosed

        errs.append(EngineClosed)
    except ImportError:
        pass
    return tuple(errs)


def overload_errors() -> tuple[type[BaseException], ...]:
    try:
        from omniloop_scheduler import QueueFull

        return (QueueFull,)
    except ImportError:
        return ()


# --------------------------------------------------------------------------------------------
# Cost estimate
# --------------------------------------------------------------------------------------------


class CostEstimator:
    """Predicted seconds of one request on this worker's device.

    The denoise part comes from the engine's cost model (``pool.cost``: seconds per step for the
    request's (model, frames x height x width, guidance branches), calibrated from measured
    steps); the rest (text encode, VAE decode, encoding the mp4) is an exponential moving
    average of what the worker measured beyond it. Without the scheduler's cost model, the whole
    request is predicted from seconds per (step x pixel x branch) measured on this worker.
    """

    def __init__(self, runtime: Any, engine: Any, alpha: float = 0.3) -> None:
        self.runtime = runtime
        self.engine = engine
        self.alpha = alpha
        self.overhead: float | None = None  # seconds beyond the denoise loop
        self.per_unit: float | None = None  # fallback: seconds per step x megapixel x branch
        self._shape_of: Any = None
        try:
            from omniloop_scheduler import shape_of

            self._shape_of = shape_of
        except ImportError:
            pass

    def shape(self, request: OmniRequest) -> Any:
        return self._shape_of(self.runtime, request) if self._shape_of is not None else None

    def _loop_seconds(self, shape: Any) -> float | None:
        cost = getattr(getattr(self.engine, "pool", None), "cost", None)
        if cost is None or shape is None:
            return None
        try:
            return float(cost.remaining_seconds(shape, shape.steps))
        except Exception:
            return None

    @staticmethod
    def _units(shape: Any) -> float:
        return shape.steps * shape.branches * shape.pixels / 1e6

    def predict(self, request: OmniRequest) -> float | None:
        shape = self.shape(request)
        loop = self._loop_seconds(shape)
        if loop is not None:
            return loop + (self.overhead or 0.0)
        if shape is not None and self.per_unit is not None:
            return self._units(shape) * self.per_unit
        return None

    def observe(self, request: OmniRequest, seconds: float, output: OmniOutput | None) -> None:
        """Calibrate from one finished request (``seconds``: submit to response ready)."""
        shape = self.shape(request)
        if shape is None or seconds <= 0:
            return
        loop_s = None
        if output is not None:
            node_s = output.metrics.get("node_seconds") or {}
            steps = output.metrics.get("step_seconds")
            if isinstance(steps, list) and steps:
                loop_s = float(sum(steps))
            elif isinstance(node_s, Mapping):
                loop_s = float(node_s.get("denoise", 0.0)) or None
        if loop_s is not None:
            extra = max(0.0, seconds - loop_s)
            self.overhead = extra if self.overhead is None else (1 - self.alpha) * self.overhead + self.alpha * extra
        units = self._units(shape)
        if units > 0:
            v = seconds / units
            self.per_unit = v if self.per_unit is None else (1 - self.alpha) * self.per_unit + self.alpha * v

    def describe(self) -> dict[str, Any]:
        cost = getattr(getattr(self.engine, "pool", None), "cost", None)
        snap = {}
        if cost is not None:
            try:
                snap = cost.snapshot().get("seconds_per_unit", {})
            except Exception:
                snap = {}
        return {
            "overhead_seconds": self.overhead,
            "seconds_per_step_megapixel_branch": self.per_unit,
            "loop_seconds_per_unit": snap,
        }


# --------------------------------------------------------------------------------------------
# Fallback engine
# --------------------------------------------------------------------------------------------


class _Handle(EventStream):
    def __init__(self, request: OmniRequest, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.request = request
        self.request_id = request.request_id
        self.execution: Any = None

    def _deliver(self, ev: OmniEvent) -> None:
        self._events.append(ev)
        if ev.kind is EventKind.FINAL and ev.output is not None and not self._result.done():
            self._finish(ev.output)
        self._notify()


class ThreadEngine:
    """One compute thread running requests one at a time with the deploy's scheduler."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._handles: dict[str, _Handle] = {}
        self._queue: list[_Handle] = []
        self._cv = threading.Condition()
        self._state = "new"
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.worker_error: BaseException | None = None
        self.counts = {"submitted": 0, "completed": 0, "failed": 0, "cancelled": 0}

    async def start(self) -> ThreadEngine:
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        self._thread = threading.Thread(target=self._run, name="omniloop-dynamo-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def accepting(self) -> bool:
        return self._state == "running"

    def submit(self, request: OmniRequest | Mapping[str, Any]) -> _Handle:
        if not self.accepting:
            raise EngineClosedError("the engine is shutting down and takes no new requests")
        req = request if isinstance(request, OmniRequest) else request_from_dict(request)
        execution = self.runtime.prepare(req)  # validates before any compute
        assert self._loop is not None
        h = _Handle(req, self._loop)
        h.execution = execution
        with self._cv:
            self._handles[req.request_id] = h
            self._queue.append(h)
            self.counts["submitted"] += 1
            self._cv.notify_all()
        return h

    def cancel(self, request_id: str) -> bool:
        h = self._handles.get(request_id)
        if h is None or h.done():
            return False
        h.execution.cancel()
        return True

    def forget(self, request_id: str) -> None:
        h = self._handles.get(request_id)
        if h is not None and h.done():
            del self._handles[request_id]

    async def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        with self._cv:
            self._state = "draining"
            if not drain:
                for h in self._queue:
                    h.execution.cancel()
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                for h in list(self._handles.values()):
                    if not h.done():
                        h.execution.cancel()
                await asyncio.to_thread(self._thread.join, 60.0)
        self._state = "stopped"

    def stats(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self._queue)
        running = sum(1 for h in self._handles.values() if not h.done()) - waiting
        return {
            "scheduler": "fallback-thread", "submitted": self.counts["submitted"], "waiting": waiting,
            "running": max(0, running),
            "finished": {k: v for k, v in self.counts.items() if k != "submitted"},
        }

    def _emit(self, h: _Handle, ev: OmniEvent) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(h._deliver, ev)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and self._state == "running":
                    self._cv.wait(timeout=1.0)
                if not self._queue:
                    return
                h = self._queue.pop(0)
            t0 = time.perf_counter()
            final: OmniEvent | None = None
            try:
                for ev in self.runtime.scheduler.stream(h.execution):
                    if ev.kind is EventKind.FINAL:
                        final = ev
                    else:
                        self._emit(h, ev)
            except BaseException as exc:  # never leave a caller hanging
                log.exception("request %s failed in the engine thread", h.request_id)
                out = OmniOutput(h.request_id, Status.FAILED, error=ErrorInfo(type(exc).__name__, str(exc)))
                final = OmniEvent(h.request_id, EventKind.FINAL, output=out)
            if final is None:
                final = OmniEvent(h.request_id, EventKind.FINAL, output=h.execution.output)
            assert final.output is not None
            final.output.metrics.setdefault("total_seconds", time.perf_counter() - t0)
            self.counts[final.output.status.value] = self.counts.get(final.output.status.value, 0) + 1
            self._emit(h, final)


__all__ = ["CostEstimator", "EngineClosedError", "ThreadEngine", "make_engine"]
