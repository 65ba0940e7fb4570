"""Interceptors: plugins that *alter* computation, resolved once at pipeline build.

Observers only read (see :mod:`omniloop.observers`); interceptors change what is computed, so
they are not hook events but objects bound to a loop node at build and called directly:

* a :class:`BlockInterceptor` runs a family's transformer block stack (DBCache, first-block
  cache, block taps). A family runs its blocks through :func:`run_blocks`; with nothing bound that
  is a plain Python loop, so it compiles and costs nothing.
* a :class:`StepInterceptor` wraps one model forward of one guidance branch (TeaCache-style
  whole-step skipping). Families call :func:`call_model`.

Capabilities are declared attributes checked before dispatch: ``graph_safe`` (safe under
``torch.compile`` / CUDA graphs), ``distribution_altering`` (changes outputs; refused for
``exact`` requests), ``needs_eager`` (forces eager execution of what it touches).

Per-request state: an interceptor keeps nothing per request on itself. The runtime calls
``open(loop_ctx)`` after the loop's ``init`` (once per guidance branch) and stores what it returns
in ``LoopState.plugin_state[(name, branch)]``; it calls ``close`` at finalize, cancel or failure.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Union, runtime_checkable

import torch
from attrs import define

from .cancel import check_cancelled
from .errors import HookDeprecationWarning
from .loop import LoopState, StepContext

BlockCall = Callable[[Any, torch.Tensor], torch.Tensor]
#: a block stack: a list of modules or an ``nn.ModuleList``
Blocks = Union[Sequence[Any], torch.nn.ModuleList]  # noqa: UP007 (a runtime alias)


@define
class BlockContext:
    """Passed to ``run_blocks``: which request, branch and step this forward belongs to."""

    step: StepContext
    loop: LoopState
    interceptor: BlockInterceptor | None = None
    #: observers asking for per-block outputs (already filtered by their module regex)
    block_tap: Callable[[str, torch.Tensor], None] | None = None
    #: module name prefix of the block list, used for taps (e.g. "transformer.blocks")
    prefix: str = "blocks"

    @property
    def state(self) -> Any:
        """This interceptor's per-(request, branch) state, as returned by ``open``."""
        if self.interceptor is None:
            return None
        return self.loop.plugin_state.get((self.interceptor.name, self.step.branch))


@runtime_checkable
class BlockInterceptor(Protocol):
    name: str
    graph_safe: bool
    distribution_altering: bool
    needs_eager: bool

    def open(self, step: StepContext, loop: LoopState, params: Any) -> Any:
        """Allocate per-(request, branch) state; ``step.branch`` names the branch; ``params`` is
        this request's ``plugin_params[name]`` validated against the plugin's ``params_schema``
        (its defaults when the request did not tune it; None when the plugin has no schema)."""

    def run(
        self, blocks: Blocks, hidden: torch.Tensor, ctx: BlockContext, call: BlockCall
    ) -> torch.Tensor:
        """Run ``blocks`` on ``hidden`` (``call(block, hidden) -> hidden``), possibly skipping some."""

    def close(self, state: Any) -> None:
        """Release what ``open`` allocated. Called at finalize, cancel and failure."""

    def metrics(self, state: Any) -> dict[str, Any]:
        """Per-request statistics merged into ``OmniOutput.metrics`` under the interceptor's name."""


@runtime_checkable
class StepInterceptor(Protocol):
    name: str
    graph_safe: bool
    distribution_altering: bool
    needs_eager: bool

    def open(self, step: StepContext, loop: LoopState, params: Any) -> Any: ...

    def forward(
        self, step: StepContext, state: Any, inputs: dict[str, Any], compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """Return the model prediction for this branch: ``compute()`` or a cheaper estimate."""

    def close(self, state: Any) -> None: ...

    def metrics(self, state: Any) -> dict[str, Any]: ...


def run_blocks(
    blocks: Blocks, hidden: torch.Tensor, ctx: BlockContext | None, call: BlockCall
) -> torch.Tensor:
    """Run a transformer block stack. A plain loop when nothing is bound.

    ``call(block, hidden)`` runs one block and returns the new hidden states (the family closes
    over everything else a block needs: conditioning, rotary embeddings, masks).

    Before each block it checks the running request's cancel flag (:mod:`omniloop.cancel`): a
    cancelled request stops within one block, not at the end of the step.
    """
    if ctx is None or (ctx.interceptor is None and ctx.block_tap is None):
        for block in blocks:
            check_cancelled()
            hidden = call(block, hidden)
        return hidden
    call = _cancellable(call)
    if ctx.block_tap is not None:
        call = _tapping(call, blocks, ctx.block_tap, ctx.prefix)
    if ctx.interceptor is None:
        for block in blocks:
            hidden = call(block, hidden)
        return hidden
    return ctx.interceptor.run(blocks, hidden, ctx, call)


def _cancellable(call: BlockCall) -> BlockCall:
    def checked(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        check_cancelled()
        return call(block, hidden)

    return checked


def _tapping(
    call: BlockCall, blocks: Blocks, tap: Callable[[str, torch.Tensor], None], prefix: str
) -> BlockCall:
    index = {id(b): i for i, b in enumerate(blocks)}

    def tapped(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        out = call(block, hidden)
        tap(f"{prefix}.{index[id(block)]}", out)
        return out

    return tapped


def call_model(
    interceptors: Sequence[StepInterceptor],
    step: StepContext,
    loop: LoopState,
    inputs: dict[str, Any],
    compute: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """Compute one branch's model prediction through the bound step interceptors (outermost first)."""
    if not interceptors:
        return compute()
    fn = compute
    for icpt in reversed(interceptors):
        fn = _wrap(icpt, step, loop, inputs, fn)
    return fn()


def _wrap(
    icpt: StepInterceptor,
    step: StepContext,
    loop: LoopState,
    inputs: dict[str, Any],
    inner: Callable[[], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    state = loop.plugin_state.get((icpt.name, step.branch))
    return lambda: icpt.forward(step, state, inputs, inner)


def open_interceptor(icpt: BlockInterceptor | StepInterceptor, step: StepContext, loop: LoopState, params: Any) -> Any:
    """Call ``icpt.open(step, loop, params)``; an interceptor written against the 1.0 signature
    ``open(step, loop)`` still works for the 1.x series and warns :class:`HookDeprecationWarning`
    (it can read ``loop.extra["plugin_params"]`` until 2.0)."""
    if _takes_params(type(icpt).open if hasattr(type(icpt), "open") else icpt.open):
        return icpt.open(step, loop, params)
    warnings.warn(
        f"interceptor {getattr(icpt, 'name', type(icpt).__name__)!r}: open(step, loop) is deprecated; "
        "define open(step, loop, params) — the request's validated plugin params are passed explicitly",
        HookDeprecationWarning, stacklevel=2,
    )
    return icpt.open(step, loop)  # type: ignore[call-arg]


_TAKES_PARAMS: dict[Any, bool] = {}


def _takes_params(fn: Any) -> bool:
    try:
        return _TAKES_PARAMS[fn]
    except (KeyError, TypeError):
        pass
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    ps = list(sig.parameters.values())
    if ps and ps[0].name == "self":
        ps = ps[1:]
    ok = "params" in sig.parameters or any(p.kind is p.VAR_POSITIONAL for p in ps) or len(
        [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3
    try:
        _TAKES_PARAMS[fn] = ok
    except TypeError:
        pass
    return ok
