"""A block interceptor: it runs the family's transformer blocks, so it could skip or cache them.

This one runs every block unchanged and counts the calls, which makes it a safe template:

* the interceptor object is shared by every request; it keeps *nothing* per request on itself;
* ``open`` is called once per (request, guidance branch) after the loop's ``init``; what it returns
  is that request-branch's state (the runtime stores it in ``LoopState.plugin_state`` and hands it
  back as ``ctx.state``);
* ``metrics(state)`` is merged into ``OmniOutput.metrics["plugins"]["block-counter"][branch]``;
  ``close(state)`` runs at finalize, cancel and failure, always;
* a request tunes it with ``plugin_params["block-counter"]``: the runtime validates it once against
  :class:`BlockCounterParams` and passes it to ``open`` as ``params`` (None when the request sent none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from omniloop.interceptors import BlockCall, BlockContext
from omniloop.loop import LoopState, StepContext


@attrs.define(frozen=True)
class BlockCounterParams:
    """Per-request knobs (``--plugin-param block-counter.per_block=true``)."""

    #: also count calls per block index
    per_block: bool = False


@attrs.define
class CounterState:
    per_block: bool
    forwards: int = 0
    block_calls: int = 0
    by_block: dict[int, int] = attrs.Factory(dict)


class BlockCounter:
    name = "block-counter"
    graph_safe = True  # plain Python around the blocks: nothing that breaks torch.compile regions
    distribution_altering = False
    needs_eager = False

    def open(self, step: StepContext, loop: LoopState, params: BlockCounterParams | None = None) -> CounterState:
        return CounterState(per_block=(params or BlockCounterParams()).per_block)

    def run(self, blocks: Sequence[Any], hidden: Any, ctx: BlockContext, call: BlockCall) -> Any:
        state: CounterState = ctx.state
        state.forwards += 1
        for i, block in enumerate(blocks):
            hidden = call(block, hidden)
            state.block_calls += 1
            if state.per_block:
                state.by_block[i] = state.by_block.get(i, 0) + 1
        return hidden

    def metrics(self, state: CounterState) -> dict[str, Any]:
        out: dict[str, Any] = {"forwards": state.forwards, "block_calls": state.block_calls}
        if state.per_block:
            out["by_block"] = dict(state.by_block)
        return out

    def close(self, state: CounterState) -> None:
        state.by_block.clear()
