"""The loop contract: one-shot ``Stage`` nodes and iterative ``LoopStage`` nodes.

The runtime, not the model, owns iteration. A ``LoopStage`` does exactly one solver step (or one
token, or one chunk) per :meth:`LoopStage.step`; a scheduler decides when to call it, so it can
interleave, batch, cancel and stream steps of many requests.

Per-request mutable state lives in :class:`RequestState` / :class:`LoopState` and nowhere else:
policies and plugins keep their state in ``LoopState.policy_state`` / ``LoopState.plugin_state``
(keyed by ``(plugin, guidance branch)``), never on the stage or in module globals, so two
interleaved requests cannot see each other's state.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import attrs
import torch
from attrs import define

from .artifacts import Artifact
from .errors import GraphError
from .request import OmniRequest

if TYPE_CHECKING:
    from .graph import Node
    from .interceptors import BlockContext, BlockInterceptor, StepInterceptor
    from .observers import ObserverBus

A = TypeVar("A", bound=Artifact)


@define(frozen=True)
class StepContext:
    """What a policy or interceptor may know about the step being computed.

    Passed explicitly (never read from globals), so one policy can observe another: the adaptive
    CFG gate sees ``expert`` change when the expert router switches transformers.
    """

    request_id: str
    node: str
    step_index: int
    num_steps: int
    timestep: float
    branch: str | None = None
    expert: str | None = None

    def with_branch(self, branch: str | None) -> StepContext:
        return attrs.evolve(self, branch=branch)


@define
class LoopState:
    """Per-request state of one loop node. Allocated by ``LoopStage.init``, released at finalize."""

    step: int = 0
    total: int = 0
    tensors: dict[str, torch.Tensor] = attrs.Factory(dict)
    #: guidance branches declared by the CFG policy at init, e.g. ("cond", "uncond")
    branches: tuple[str, ...] = ("cond",)
    #: per-request state of the policies bound to this loop, by policy role ("sampler", "cfg", ...)
    policy_state: dict[str, Any] = attrs.Factory(dict)
    #: per-request state of plugins (interceptors, observers), by (plugin name, guidance branch)
    plugin_state: dict[tuple[str, str | None], Any] = attrs.Factory(dict)
    #: family-private values (timesteps, scheduler instance, expert in use, ...)
    extra: dict[str, Any] = attrs.Factory(dict)
    done: bool = False


@define
class StepResult:
    """What one ``step()`` returns: whether the loop is finished, and partial artifacts to emit."""

    done: bool
    emit: dict[str, Artifact] = attrs.Factory(dict)


@define
class RequestState:
    """Everything one request owns while it runs: artifacts by edge name, loop states, RNG, metrics."""

    request: OmniRequest
    artifacts: dict[str, Artifact] = attrs.Factory(dict)
    loops: dict[str, LoopState] = attrs.Factory(dict)
    generator: torch.Generator | None = None
    metrics: dict[str, Any] = attrs.Factory(dict)
    #: typed per-family extension (the family decides what it stores here)
    ext: dict[str, Any] = attrs.Factory(dict)
    #: the family's resolved form of the request (``omniloop.resolved.Resolved``), as on
    #: ``StageContext.resolved`` — for stage methods that get no context (``kv_demand``)
    resolved: Any = None

    def read(self, name: str, kind: type[A] | None = None) -> A:
        try:
            art = self.artifacts[name]
        except KeyError:
            raise GraphError(f"artifact {name!r} was read before any node wrote it") from None
        if kind is not None and not isinstance(art, kind):
            raise GraphError(f"artifact {name!r} is {type(art).__name__}, expected {kind.__name__}")
        return art  # type: ignore[return-value]

    def get(self, name: str) -> Artifact | None:
        return self.artifacts.get(name)

    def write(self, name: str, artifact: Artifact, producer: str | None = None) -> None:
        if producer is not None:
            artifact.producer = producer
        self.artifacts[name] = artifact


@define
class StageContext:
    """What the runtime hands a node when it runs it for one request.

    ``components`` are the family's loaded modules, shared by reference between pipelines and
    requests (read-only during a step). ``params`` are the node's validated per-request params.
    """

    request: OmniRequest
    node: Node
    components: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    params: Any = None
    #: the family's resolved form of the whole request (``Runtime.prepare`` resolves it once;
    #: an ``omniloop.resolved.Resolved``), or None when a stage runs outside a runtime
    resolved: Any = None
    observers: ObserverBus | None = None
    block_interceptor: BlockInterceptor | None = None
    step_interceptors: tuple[StepInterceptor, ...] = ()
    #: True when a bound plugin needs eager execution of what it watches (no compiled blocks)
    eager: bool = False
    #: family/deploy options (attention backend, compile flag, limits)
    options: dict[str, Any] = attrs.Factory(dict)
    #: block-module names observers want as taps (None: no block taps, blocks run untouched)
    block_taps: re.Pattern[str] | None = None

    def block_context(self, step: StepContext, loop: LoopState, prefix: str = "blocks") -> BlockContext | None:
        """The ``BlockContext`` to pass to ``run_blocks`` for this branch forward (None when nothing is bound)."""
        from .interceptors import BlockContext

        if self.block_interceptor is None and self.block_taps is None:
            return None
        tap = None
        if self.block_taps is not None:
            pattern = self.block_taps

            def tap(name: str, value: torch.Tensor) -> None:
                if pattern.search(name):
                    self.tap(name, value, step)

        return BlockContext(step=step, loop=loop, interceptor=self.block_interceptor, block_tap=tap, prefix=prefix)

    def tap(self, name: str, value: Any, step: StepContext | None = None) -> None:
        """Offer a named tensor to observers. Free when no observer listens to taps."""
        bus = self.observers
        if bus is not None and bus.tap is not None:
            bus.tap(request=self.request, node=self.node.name, step=step, name=name, value=value)

    @property
    def taps_enabled(self) -> bool:
        bus = self.observers
        return bus is not None and bus.tap is not None


@runtime_checkable
class Stage(Protocol):
    """A one-shot node: encoders, VAE, packers, vocoders."""

    def forward(self, ctx: StageContext, state: RequestState) -> None: ...


@runtime_checkable
class LoopStage(Protocol):
    """An iterative node. The runtime calls ``init`` once, ``step`` until done, ``finalize`` once."""

    def init(self, ctx: StageContext, state: RequestState) -> LoopState: ...

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult: ...

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None: ...


@runtime_checkable
class BatchedLoopStage(LoopStage, Protocol):
    """A loop that can run one step of several requests as one batched forward.

    ``batch_key`` returns a hashable describing what must match (model, shape, sampler, guidance
    policy) or None when this step cannot be batched. ``step_batch`` must give each request exactly
    the result ``step`` would give it alone, up to the tolerance the family documents.
    """

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None: ...

    def step_batch(
        self,
        ctxs: Sequence[StageContext],
        states: Sequence[RequestState],
        loops: Sequence[LoopState],
    ) -> list[StepResult]: ...


def is_loop_stage(stage: object) -> bool:
    return all(callable(getattr(stage, m, None)) for m in ("init", "step", "finalize"))


def is_batched(stage: object) -> bool:
    return is_loop_stage(stage) and callable(getattr(stage, "step_batch", None)) and callable(
        getattr(stage, "batch_key", None)
    )
