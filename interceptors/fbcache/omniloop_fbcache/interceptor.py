"""``FirstBlockCache``: skip the rest of the block stack while the first block barely changes.

Per forward of one (request, guidance branch), inside ``omniloop.run_blocks``:

1. run the first block; ``r = hidden_after - hidden_before`` (its residual);
2. after warmup, compare ``r`` with the residual of the last *computed* step:
   ``mean|r - r_ref| / mean|r_ref|``;
3. below the threshold: add the remaining blocks' residual stored at that computed step and
   return (the other blocks are skipped); otherwise run them, store their residual and ``r``.

On computed steps the output is exactly the plain loop's, so with ``threshold: 0`` a request is
bit-identical to running without the interceptor.

Everything a request owns lives in the :class:`FBCacheState` that ``open`` returns; the runtime
keeps it in ``LoopState.plugin_state[("fbcache", branch)]`` and hands it back through
``BlockContext.state``. The interceptor object itself is shared by every request and holds only
its deploy config, so interleaved requests cannot see each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from attrs import define, field

from omniloop.errors import PluginError
from omniloop.interceptors import BlockCall, BlockContext
from omniloop.loop import LoopState, StepContext
from omniloop.schema import structure_config

from .config import FBCacheConfig, FBCacheParams, resolve

NAME = "fbcache"


@define(eq=False)
class FBCacheState:
    """One (request, guidance branch): settings, the two cached tensors, and statistics."""

    branch: str
    settings: FBCacheConfig
    #: the first block's residual at the last computed step (the reference for the decision)
    ref_residual: torch.Tensor | None = None
    #: what the remaining blocks added at that step (reused on cached steps)
    rest_residual: torch.Tensor | None = None
    #: which block list produced them (a family may switch transformers mid-loop, e.g. MoE experts)
    blocks_key: int | None = None
    consecutive: int = 0
    forwards: int = 0
    cached_steps: list[int] = field(factory=list)
    diffs: dict[int, float] = field(factory=dict)
    closed: bool = False


class FirstBlockCache:
    """The block interceptor. One instance per deployment, shared by all requests."""

    name = NAME
    #: the request-parameter schema (``plugin_params["fbcache"]``), as registered
    params_schema = FBCacheParams
    #: the skip decision reads a tensor on the host (.item()), so it cannot live in a CUDA graph
    graph_safe = False
    #: cached steps approximate the model: exact requests bypass this interceptor
    distribution_altering = True
    #: blocks may be compiled; only this Python wrapper runs eagerly
    needs_eager = False

    def __init__(self, config: FBCacheConfig | Mapping[str, Any] | None = None, *, process_group: Any = None) -> None:
        self.config = structure_config(FBCacheConfig, config, f"plugins.{NAME}")
        self.process_group = process_group

    def bind_process_group(self, group: Any) -> None:
        """Under sequence parallelism every rank must decide alike: reduce the decision over ``group``."""
        self.process_group = group

    # -- the BlockInterceptor protocol ---------------------------------------------------------

    def open(self, step: StepContext, loop: LoopState, params: FBCacheParams | None = None) -> FBCacheState:
        """``params``: the request's ``plugin_params["fbcache"]``, validated once by the runtime."""
        return FBCacheState(branch=step.branch or "cond", settings=resolve(self.config, params))

    def run(self, blocks: Sequence[Any], hidden: torch.Tensor, ctx: BlockContext, call: BlockCall) -> torch.Tensor:
        st = ctx.state
        if not isinstance(st, FBCacheState) or st.closed:
            raise PluginError(f"{NAME}: no open state for branch {ctx.step.branch!r} (open() not called, or closed)")
        st.forwards += 1
        if len(blocks) < 2:  # nothing to skip
            for block in blocks:
                hidden = call(block, hidden)
            return hidden

        key = id(blocks[0])
        if st.blocks_key != key:  # another transformer: its residuals are not comparable
            st.ref_residual = st.rest_residual = None
            st.blocks_key = key

        before = hidden
        hidden = call(blocks[0], hidden)
        residual = hidden - before

        if self._can_reuse(st, residual, ctx.step.step_index):
            st.consecutive += 1
            st.cached_steps.append(ctx.step.step_index)
            assert st.rest_residual is not None
            return hidden + st.rest_residual

        st.consecutive = 0
        rest_in = hidden
        for block in blocks[1:]:
            hidden = call(block, hidden)
        st.ref_residual = residual
        st.rest_residual = hidden - rest_in
        return hidden

    def close(self, state: Any) -> None:
        if isinstance(state, FBCacheState):
            state.ref_residual = state.rest_residual = None
            state.closed = True

    def metrics(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, FBCacheState):
            return {}
        s = state.settings
        return {
            "branch": state.branch,
            "settings": f"R{s.threshold}_W{s.warmup_steps}_MC{s.max_consecutive_cached}",
            "forwards": state.forwards,
            "computed_steps": state.forwards - len(state.cached_steps),
            "num_cached_steps": len(state.cached_steps),
            "cached_steps": list(state.cached_steps),
            "residual_diffs": {str(k): v for k, v in state.diffs.items()},
        }

    # -- the decision ---------------------------------------------------------------------------

    def _can_reuse(self, st: FBCacheState, residual: torch.Tensor, step_index: int) -> bool:
        s = st.settings
        if s.threshold <= 0.0 or step_index < s.warmup_steps:
            return False
        if st.ref_residual is None or st.rest_residual is None or st.ref_residual.shape != residual.shape:
            return False
        if 0 <= s.max_consecutive_cached <= st.consecutive:
            return False
        diff = self._relative_l1(st.ref_residual, residual)
        st.diffs[step_index] = diff
        return diff < s.threshold

    def _relative_l1(self, ref: torch.Tensor, cur: torch.Tensor) -> float:
        # sums (in float32), not means: exact for uneven sequence shards once reduced
        sums = torch.stack([(ref - cur).abs().sum(dtype=torch.float32), ref.abs().sum(dtype=torch.float32)])
        group = self.process_group
        if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        num, den = sums.tolist()  # the one host sync per forward
        return num / den if den > 0 else float("inf")
