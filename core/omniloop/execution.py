"""One request's execution as a state machine a scheduler drives.

:meth:`Execution.advance` runs exactly one unit of work — a ``Stage.forward`` or one
``LoopStage.step`` (a loop's ``init`` runs together with its first step) — and returns the events
it produced. A scheduler decides which execution advances next: ``serial`` runs one to the end,
``step`` interleaves many and co-batches compatible loop steps through :func:`advance_batch`.

The execution owns the request's lifecycle guarantees:

* interceptors are opened once per guidance branch after ``init`` and closed at finalize,
  cancel or failure — always;
* an exception in a node fails this request only (status ``failed``, the error with node and
  step, the artifacts that were complete) — any ``BaseException`` but ``KeyboardInterrupt``, so a
  plugin calling ``sys.exit()`` in a step fails its request, not the process; Ctrl-C cancels the
  request (interceptors closed, observers told) and propagates;
* ``cancel()`` takes effect at the next unit boundary, or — inside a running step — before the
  next transformer block (:mod:`omniloop.cancel`; it may be called from another thread), and
  returns the complete artifacts, status ``cancelled``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch
from attrs import define

from . import rl as _rl
from .cancel import watching
from .context import StageContext
from .errors import CancelledError, OmniloopError
from .family import RequestScope
from .graph import Node, PipelineSpec
from .interceptors import BlockInterceptor, StepInterceptor, open_interceptor
from .loop import LoopState, RequestState, StepContext, StepResult
from .observers import ObserverBus
from .request import ErrorInfo, EventKind, OmniEvent, OmniOutput, OmniRequest, Status
from .resolved import Resolved
from .scheduling import ScheduleDecision as ScheduleDecision  # re-exported (its first home)

log = logging.getLogger("omniloop.execution")


@define
class BuiltPipeline:
    """A pipeline bound for one runtime: spec plus what is resolved at build."""

    spec: PipelineSpec
    components: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    bus: ObserverBus | None = None
    block_interceptor: BlockInterceptor | None = None
    step_interceptors: tuple[StepInterceptor, ...] = ()
    eager: bool = False
    options: dict[str, Any] = attrs.Factory(dict)
    model_name: str = ""

    @property
    def interceptors(self) -> tuple[Any, ...]:
        head = (self.block_interceptor,) if self.block_interceptor is not None else ()
        return head + self.step_interceptors


class Execution:
    """The state machine of one request through one built pipeline."""

    def __init__(
        self,
        pipeline: BuiltPipeline,
        request: OmniRequest,
        *,
        node_params: dict[str, Any] | None = None,
        plugin_params: dict[str, Any] | None = None,
        warnings: Sequence[str] = (),
        active_interceptors: Sequence[Any] | None = None,
        resolved: Resolved | None = None,
        scopes: Sequence[RequestScope] = (),
        rollout_support: _rl.RolloutSupport | None = None,
        weight_version: str = "",
        initial_seed: int | None = None,
        rollout_seed: int | None = None,
        replay: torch.Tensor | None = None,
        lifecycle: Any = None,
        retry_alone: frozenset[str] = frozenset(),
    ) -> None:
        self.pipeline = pipeline
        #: loop nodes whose batched forward, when it raises, is re-run one request at a time
        #: (the family's ``capabilities.step_batch_retry_alone``)
        self.retry_alone = frozenset(retry_alone)
        #: the family's rollout declaration (``request.rollout`` runs only with one)
        self.rollout_support = rollout_support
        #: the weights this request runs on (``Runtime.update_weights``); ``metrics["weight_version"]``
        self.weight_version = weight_version
        self._rollout_seed = rollout_seed
        self._replay = replay
        #: ``on_start(execution)`` before the first unit, ``on_finish(execution)`` at the end (the
        #: runtime's in-flight count, which ``update_weights`` waits on)
        self._lifecycle = lifecycle
        #: what the runtime's mechanisms run this request with (its LoRA set), entered around each unit
        self.scopes: tuple[RequestScope, ...] = tuple(scopes)
        self.request = request
        self.bus = pipeline.bus
        seed = request.diffusion.seed
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        self.seed = seed
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if initial_seed is None else initial_seed)  # same_initial_noise: the group's seed
        self.state = RequestState(request=request, generator=gen)
        self.state.metrics["seed"] = seed
        self.state.metrics["weight_version"] = weight_version
        #: the family's resolved form of the request (``Runtime.prepare`` resolves it once)
        self.resolved: Resolved | None = resolved
        self.state.resolved = resolved
        if not warnings and resolved is not None:
            warnings = resolved.warnings
        if warnings:
            self.state.metrics["warnings"] = list(warnings)
        self.nodes: tuple[Node, ...] = tuple(n for n in pipeline.spec.nodes if n.runs_for(request))
        self._node_params = node_params or {}
        self.plugin_params = plugin_params or {}
        icpts = pipeline.interceptors if active_interceptors is None else tuple(active_interceptors)
        self._block_icpt = next((i for i in icpts if i is pipeline.block_interceptor), None)
        self._step_icpts = tuple(i for i in icpts if i in pipeline.step_interceptors)
        self._index = 0
        self._ctx: StageContext | None = None
        self._loop: LoopState | None = None
        self._node_t0 = 0.0
        self.status: Status | None = None
        self.error: ErrorInfo | None = None
        self._output: OmniOutput | None = None
        self._cancel_requested = False
        self.t_start: float | None = None
        self.t_end: float | None = None
        self.steps_done = 0

    # -- introspection for schedulers --------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.status is not None

    @property
    def output(self) -> OmniOutput:
        if self._output is None:
            raise RuntimeError("execution has not finished")
        return self._output

    @property
    def current_node(self) -> Node | None:
        return self.nodes[self._index] if self._index < len(self.nodes) else None

    @property
    def loop(self) -> LoopState | None:
        return self._loop

    def progress(self) -> tuple[int, int]:
        """(steps done, steps total) of the current loop, or (0, 0) outside loops."""
        if self._loop is None:
            return (0, 0)
        return (self._loop.step, self._loop.total)

    def batch_key(self) -> Hashable | None:
        """A key equal for executions whose next unit can run as one batched step, else None."""
        node = self.current_node
        if self.done or node is None or self._loop is None or not callable(getattr(node.stage, "batch_key", None)):
            return None
        if self._cancel_requested or (self.bus is not None and not self.bus.empty):
            return None
        assert self._ctx is not None
        key = node.stage.batch_key(self._ctx, self.state, self._loop)
        if key is None:
            return None
        scoped = tuple(s.key for s in self.scopes)  # a batch never mixes adapter sets
        return (id(self.pipeline), node.name, key, scoped) if scoped else (id(self.pipeline), node.name, key)

    def activated(self) -> contextlib.ExitStack:
        """The context of one unit of this request: its scopes (LoRA set) entered, for this call only."""
        stack = contextlib.ExitStack()
        for scope in self.scopes:
            stack.enter_context(scope.activate())
        return stack

    # -- driving -------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask to cancel; takes effect at the next unit boundary (immediately if idle), or before
        the next transformer block of a step that is running (thread-safe: a flag)."""
        self._cancel_requested = True

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def advance(self) -> list[OmniEvent]:
        """Run one unit of work; return the events it produced (the last is ``final`` when done)."""
        if self.done:
            return []
        if self._lifecycle is not None:
            with self._lifecycle.unit():  # weight updates apply between units, never inside one
                return self._advance()
        return self._advance()

    def _advance(self) -> list[OmniEvent]:
        events: list[OmniEvent] = []
        if self.t_start is None:
            if self._lifecycle is not None:
                try:  # the runtime may refuse to start it now (asleep): this request fails, cleanly
                    self._lifecycle.on_start(self)
                except Exception as exc:
                    self.t_start = time.perf_counter()
                    self._fail(exc, self.current_node, events)
                    return events
            self.t_start = time.perf_counter()
            if self.bus is not None and self.bus.request_start is not None:
                self.bus.request_start(
                    request=self.request, pipeline=self.pipeline.spec, deploy=self.pipeline.options.get("deploy"),
                    plugin_params=self.plugin_params,
                )
        if self._cancel_requested:
            self._finish(Status.CANCELLED, None, events)
            return events
        node = self.current_node
        if node is None:
            self._finish(Status.COMPLETED, None, events)
            return events
        try:
            if self._ctx is None:
                self._enter(node)
            ctx = self._ctx
            assert ctx is not None
            if not node.is_loop:
                # this request's LoRA set, for this call only; its cancel flag, checked between blocks
                with self.activated(), watching(self._cancelled):
                    node.stage.forward(ctx, self.state)
                self._leave(node, events)
                self._init_next_loop()
            else:
                if self._loop is None:
                    with self.activated(), watching(self._cancelled):
                        self._init_loop(node, ctx)
                loop = self._loop
                assert loop is not None
                self._before_step(node, loop)
                t0 = time.perf_counter()
                with self.activated(), watching(self._cancelled):
                    result = node.stage.step(ctx, self.state, loop)
                self._after_step(node, loop, result, time.perf_counter() - t0, events)
                self._init_next_loop()
        except CancelledError:  # cancel() while the unit ran: it stopped between blocks
            if not self.done:
                self._finish(Status.CANCELLED, None, events)
            return events
        except KeyboardInterrupt:  # Ctrl-C stops the process: close this request cleanly first
            if not self.done:
                self._finish(Status.CANCELLED, None, events)
            raise
        except BaseException as exc:  # failure isolation (a plugin's sys.exit too): this request fails
            self._fail(exc, self.current_node or node, events)  # the next loop's, when its init failed
            return events
        if self.current_node is None and not self.done:
            self._finish(Status.COMPLETED, None, events)
        return events

    def fail(self, exc: BaseException) -> list[OmniEvent]:
        """Fail this request from outside (a scheduler's NaN check, a crashed batch); returns the events."""
        events: list[OmniEvent] = []
        if not self.done:
            self._fail(exc, self.current_node, events)
        return events

    def run(self) -> OmniOutput:
        while not self.done:
            self.advance()
        return self.output

    # -- internals -----------------------------------------------------------------------------
    def _cancelled(self) -> bool:
        return self._cancel_requested

    def _enter(self, node: Node) -> None:
        p = self.pipeline
        self._ctx = StageContext(
            request=self.request, node=node, components=p.components, device=p.device, dtype=p.dtype,
            params=self._node_params.get(node.name), resolved=self.resolved, observers=self.bus,
            block_interceptor=self._block_icpt if node.is_loop else None,
            step_interceptors=self._step_icpts if node.is_loop else (),
            eager=p.eager, options=p.options,
            block_taps=self.bus.block_tap_pattern(node.name) if self.bus is not None and node.is_loop else None,
        )
        self._node_t0 = time.perf_counter()
        if self.bus is not None and self.bus.node_start is not None:
            self.bus.node_start(request=self.request, node=node.name)

    def _leave(self, node: Node, events: list[OmniEvent]) -> None:
        dt = time.perf_counter() - self._node_t0
        self.state.metrics.setdefault("node_seconds", {})[node.name] = round(dt, 6)
        if self.bus is not None and self.bus.node_end is not None:
            self.bus.node_end(request=self.request, node=node.name, seconds=dt)
        self._ctx = None
        self._index += 1
        if self.request.outputs.stream_progress:
            events.append(OmniEvent(self.request_id, EventKind.NODE, node=node.name, message="done"))

    def _init_next_loop(self) -> None:
        """At the end of a unit that left a node: when the next node is a loop, enter it and
        initialise its state now, so that its first step can join a batched step (``batch_key``
        needs the loop state) like every later one."""
        node = self.current_node
        if node is None or not node.is_loop or self.done or self._cancel_requested or self._ctx is not None:
            return
        self._enter(node)
        assert self._ctx is not None
        with self.activated(), watching(self._cancelled):
            self._init_loop(node, self._ctx)

    def _init_loop(self, node: Node, ctx: StageContext) -> None:
        loop = node.stage.init(ctx, self.state)
        loop.extra.setdefault("plugin_params", self.plugin_params)
        rollout = self.request.rollout
        if rollout is not None and self.rollout_support is not None and node.name in self.rollout_support.nodes:
            gen = self.state.generator
            if self._rollout_seed is not None:  # same_initial_noise: the SDE noise has its own generator
                gen = torch.Generator(device="cpu").manual_seed(self._rollout_seed)
            loop.extra[_rl.ROLLOUT_KEY] = _rl.RolloutRecorder(
                rollout, gen, weight_version=self.weight_version, support=self.rollout_support, replay=self._replay)
        self.state.loops[node.name] = loop
        self._loop = loop
        for icpt in (self._block_icpt, *self._step_icpts):
            if icpt is None:
                continue
            for branch in loop.branches:
                sc = StepContext(self.request_id, node.name, 0, loop.total, 0.0, branch=branch)
                loop.plugin_state[(icpt.name, branch)] = open_interceptor(icpt, sc, loop, self.plugin_params.get(icpt.name))
        if self.bus is not None and self.bus.loop_init is not None:
            self.bus.loop_init(request=self.request, node=node.name, loop=loop)

    def _before_step(self, node: Node, loop: LoopState) -> None:
        rec = loop.extra.get(_rl.ROLLOUT_KEY)
        if rec is not None and rec.replay is not None:  # replay: the recorded state, then a fresh forward
            rec.before_step(loop.step, loop)
        if self.bus is not None and self.bus.step_start is not None:
            self.bus.step_start(request=self.request, node=node.name, step=loop.step, total=loop.total)

    def _next_or_finish(self, events: list[OmniEvent]) -> None:
        """After a batched step: the next loop entered if one follows, or the request finished
        when no node is left."""
        self._init_next_loop()
        if self.current_node is None and not self.done:
            self._finish(Status.COMPLETED, None, events)

    def _after_step(
        self, node: Node, loop: LoopState, result: StepResult, seconds: float, events: list[OmniEvent]
    ) -> None:
        if result.error is not None:  # this row failed (attributed by a batched stage): it alone
            raise result.error
        loop.step += 1
        self.steps_done += 1
        if self.bus is not None and self.bus.step_end is not None:
            self.bus.step_end(
                request=self.request, node=node.name, step=loop.step - 1, total=loop.total, loop=loop, seconds=seconds
            )
        times = self.state.metrics.setdefault("step_seconds", [])
        times.append(round(seconds, 6))
        if self.request.outputs.stream_progress:
            events.append(OmniEvent(self.request_id, EventKind.PROGRESS, node=node.name, step=loop.step, total=loop.total))
        if self.request.outputs.stream_partial:
            for name, art in result.emit.items():
                events.append(OmniEvent(self.request_id, EventKind.PARTIAL, node=node.name, step=loop.step, artifact=name, value=art))
        if result.done:
            loop.done = True
            assert self._ctx is not None
            rec = loop.extra.pop(_rl.ROLLOUT_KEY, None)
            if rec is not None:  # before the family's finalize, which may repack or drop loop tensors
                self.state.write("trajectory", rec.trajectory(loop), node.name)
            node.stage.finalize(self._ctx, self.state, loop)
            self._close_loop(node, loop)
            self._leave(node, events)

    def _close_loop(self, node: Node, loop: LoopState) -> None:
        """Close interceptors (collecting their metrics) and drop the loop's per-request state."""
        for icpt in (self._block_icpt, *self._step_icpts):
            if icpt is None:
                continue
            per_branch: dict[str, Any] = {}
            for branch in loop.branches:
                key = (icpt.name, branch)
                if key not in loop.plugin_state:
                    continue
                st = loop.plugin_state.pop(key)
                try:
                    m = icpt.metrics(st) if callable(getattr(icpt, "metrics", None)) else None
                    if m:
                        per_branch[branch] = m
                finally:
                    icpt.close(st)
            if per_branch:
                self.state.metrics.setdefault("plugins", {})[icpt.name] = per_branch
        if self.bus is not None and self.bus.loop_finalize is not None:
            self.bus.loop_finalize(request=self.request, node=node.name, loop=loop)
        self._loop = None

    def _release(self) -> None:
        node = self.current_node
        if self._loop is not None and node is not None:
            try:
                self._close_loop(node, self._loop)
            except Exception:  # releasing must not mask the original outcome
                self._loop = None
        self._ctx = None

    def _fail(self, exc: BaseException, node: Node | None, events: list[OmniEvent]) -> None:
        step = self._loop.step if self._loop is not None else None
        msg = str(exc) if isinstance(exc, OmniloopError) else f"{type(exc).__name__}: {exc}"
        self.error = ErrorInfo(type=type(exc).__name__, message=msg, node=node.name if node else None, step=step)
        self._finish(Status.FAILED, exc, events)

    def _finish(self, status: Status, exc: BaseException | None, events: list[OmniEvent]) -> None:
        if self._lifecycle is not None:
            self._lifecycle.on_finish(self)
        self._release()
        self.status = status
        self.t_end = time.perf_counter()
        out = self._build_output(status)
        self._output = out
        if self.bus is not None and self.bus.request_end is not None:
            self.bus.request_end(request=self.request, output=out)
        if status is Status.FAILED:
            events.append(OmniEvent(self.request_id, EventKind.ERROR, message=out.error.message if out.error else None))
        events.append(OmniEvent(self.request_id, EventKind.FINAL, output=out))

    def _build_output(self, status: Status) -> OmniOutput:
        arts: dict[str, Any] = {}
        for edge, name in self.pipeline.spec.outputs.items():
            art = self.state.artifacts.get(edge)
            if art is not None:
                arts[name] = art
        traj = self.state.artifacts.get("trajectory")
        if isinstance(traj, _rl.Trajectory):
            arts["trajectory"] = traj
        metrics = dict(self.state.metrics)
        if self.t_start is not None and self.t_end is not None:
            metrics["total_seconds"] = round(self.t_end - self.t_start, 6)
        metrics["steps"] = self.steps_done
        return OmniOutput(self.request_id, status, artifacts=arts, metrics=metrics, error=self.error)


def _retry_alone(executions: Sequence[Execution], node: Any, exc: BaseException,
                 out: list[list[OmniEvent]]) -> list[list[OmniEvent]]:
    """The batched forward of a node the family declares in ``step_batch_retry_alone`` raised ``exc``: run each
    request's step alone, so the one that caused it fails alone and the others go on."""
    log.warning("a batched step of node %s raised %s: running its %d requests alone", node.name,
                type(exc).__name__, len(executions))
    for ex, evs in zip(executions, out, strict=True):
        loop = ex._loop
        assert loop is not None and ex._ctx is not None
        t0 = time.perf_counter()
        try:
            with ex.activated(), watching(ex._cancelled):
                res = node.stage.step(ex._ctx, ex.state, loop)
            ex._after_step(node, loop, res, time.perf_counter() - t0, evs)
            ex._next_or_finish(evs)
        except CancelledError:  # cancelled while it ran alone
            if not ex.done:
                ex._finish(Status.CANCELLED, None, evs)
        except KeyboardInterrupt:
            raise
        except BaseException as alone_exc:
            ex._fail(alone_exc, node, evs)
    return out


def advance_batch(executions: Sequence[Execution]) -> list[list[OmniEvent]]:
    """Run one loop step of several executions that share a ``batch_key`` as one batched forward.

    Falls back to advancing each alone when the batch is of one. A stage attributes a failure to
    one member by returning ``StepResult(error=...)`` for it: that member fails alone, the others
    go on. An exception out of the batched forward of a node the family declares in
    ``capabilities.step_batch_retry_alone`` re-runs each member's step alone (only the one that
    causes it fails); of any other node it fails every member (they shared the computation, and
    nobody knows whose row caused it); each is still closed cleanly.
    """
    if len(executions) <= 1:
        return [ex.advance() for ex in executions]
    life = executions[0]._lifecycle
    if life is not None:
        with life.unit():  # weight updates apply between units, never inside one
            return _advance_batch(executions)
    return _advance_batch(executions)


def _advance_batch(executions: Sequence[Execution]) -> list[list[OmniEvent]]:
    node = executions[0].current_node
    assert node is not None
    ctxs = [ex._ctx for ex in executions]
    loops = [ex._loop for ex in executions]
    states = [ex.state for ex in executions]
    out: list[list[OmniEvent]] = [[] for _ in executions]
    for ex, loop in zip(executions, loops, strict=True):
        assert loop is not None
        ex._before_step(node, loop)
    t0 = time.perf_counter()
    def all_cancelled() -> bool:  # one member's cancel waits for the step; all of them stop it
        return all(ex._cancel_requested for ex in executions)

    try:
        with executions[0].activated(), watching(all_cancelled):  # adapters: part of batch_key
            results = node.stage.step_batch(ctxs, states, loops)
    except CancelledError:
        for ex, evs in zip(executions, out, strict=True):
            if not ex.done:
                ex._finish(Status.CANCELLED, None, evs)
        return out
    except KeyboardInterrupt:
        for ex, evs in zip(executions, out, strict=True):
            if not ex.done:
                ex._finish(Status.CANCELLED, None, evs)
        raise
    except BaseException as exc:  # a plugin's sys.exit too: these requests fail, nothing else
        if node.name in executions[0].retry_alone and isinstance(exc, Exception):
            return _retry_alone(executions, node, exc, out)
        for ex, evs in zip(executions, out, strict=True):
            ex._fail(exc, node, evs)
        return out
    dt = (time.perf_counter() - t0) / len(executions)
    for ex, loop, res, evs in zip(executions, loops, results, out, strict=True):
        assert loop is not None
        try:
            ex._after_step(node, loop, res, dt, evs)
            ex._next_or_finish(evs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            ex._fail(exc, node, evs)
    return out
