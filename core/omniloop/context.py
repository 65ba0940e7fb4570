"""What the runtime hands a node: :class:`StageContext`, and the node protocols that take it.

This module ties the loop contract (:mod:`omniloop.loop`) to the graph's nodes, the interceptors
and the observers; it imports all four and none of them imports it, so the core's imports form no
cycle. Import these names from here or from ``omniloop``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from attrs import define

from .graph import Node
from .interceptors import BlockContext, BlockInterceptor, StepInterceptor
from .loop import LoopState, RequestState, StepContext, StepResult
from .observers import ObserverBus
from .request import OmniRequest


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

    Failure isolation: ``step_batch`` attributes a failure to one request by returning
    ``StepResult(error=...)`` for it. A family may also name the node in its
    ``capabilities.step_batch_retry_alone`` (:mod:`omniloop.capabilities`): its ``step_batch``
    changes no request state until its batched forward has returned, so when that forward raises,
    the runtime runs the step of each request alone (``step``) — the one that caused it fails
    alone, the others go on.
    """

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None: ...

    def step_batch(
        self,
        ctxs: Sequence[StageContext],
        states: Sequence[RequestState],
        loops: Sequence[LoopState],
    ) -> list[StepResult]: ...


__all__ = ["BatchedLoopStage", "LoopStage", "Stage", "StageContext"]
