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

import sys
import warnings
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from attrs import define

from .artifacts import Artifact
from .errors import GraphError, HookDeprecationWarning
from .request import OmniRequest

if TYPE_CHECKING:
    import torch

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
    """What one ``step()`` returns: whether the loop is finished, and partial artifacts to emit.

    ``error``: this request's step failed (a batched ``step_batch`` attributes a failure to the one
    row that caused it — a non-finite row, a bad sampling draw — instead of raising, which would
    fail every request of the batch); the runtime fails that request alone with it.
    """

    done: bool
    emit: dict[str, Artifact] = attrs.Factory(dict)
    error: BaseException | None = None


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


#: names that moved to :mod:`omniloop.context` (the module tying loops to graph, interceptors and
#: observers, so that core imports form no cycle); importing them from here warns until 2.0
_MOVED = frozenset({"StageContext", "Stage", "LoopStage", "BatchedLoopStage"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        # not an import: context imports this module, so loop stays below it; the package's __init__
        # has loaded omniloop.context before anyone can reach this (issue 34: no import cycle)
        context = sys.modules[f"{__package__}.context"]
        warnings.warn(f"omniloop.loop.{name} moved to omniloop.context.{name} (or import it from omniloop)",
                      HookDeprecationWarning, stacklevel=2)
        return getattr(context, name)
    raise AttributeError(f"module 'omniloop.loop' has no attribute {name!r}")


def is_loop_stage(stage: object) -> bool:
    return all(callable(getattr(stage, m, None)) for m in ("init", "step", "finalize"))


def is_batched(stage: object) -> bool:
    return is_loop_stage(stage) and callable(getattr(stage, "step_batch", None)) and callable(
        getattr(stage, "batch_key", None)
    )
