"""``CacheDiTInterceptor``: cache-dit's DBCache (+ TaylorSeer) behind omniloop's block-interceptor contract.

Per forward of one (request, guidance branch), through :func:`omniloop.run_blocks`:

1. run the first ``Fn`` blocks; ``fn_res = hidden - hidden_in``;
2. in this branch's cache-dit context: ``mark_step_begin``; ``can_cache(fn_res)`` (warmup, max
   cached / continuous cached steps, then the relative L1 change of ``fn_res`` against the last
   computed step's, below ``residual_diff_threshold``);
3. hit: ``apply_cache`` adds the stored middle-block residual (or TaylorSeer's extrapolation of
   it); miss: store ``fn_res``, run the middle blocks, store their residual;
4. run the last ``Bn`` blocks.

This is the sequence of cache-dit's own ``CachedBlocks_Pattern_Base.forward`` (1.5.3), calling the
same manager methods in the same order, so the outputs are bit-identical to
``cache_dit.enable_cache`` on the same blocks (tested on diffusers' Wan transformer).

State: one cache-dit context per (request, branch, block list) inside one manager per block list
(= per loaded transformer; Wan2.2's two experts get separate contexts, as in cache-dit). Each
branch is its own context with ``enable_separate_cfg=False``, so CFG branches never share
buffers and nothing depends on call parity. The context is created on the branch's first
forward (``open`` cannot know which transformer will run) and removed by ``close``.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from attrs import define, field

from omniloop.errors import DeployError, PluginError, RequestError
from omniloop.interceptors import BlockCall, BlockContext
from omniloop.loop import LoopState, StepContext
from omniloop.schema import structure_config

from . import _cachedit
from .config import CacheDiTConfig, CacheDiTParams, resolve
from .manager import OmniloopContextManager, group_is_active

NAME = "cache-dit"


def settings_tag(s: CacheDiTConfig) -> str:
    """cache-dit-style short tag, e.g. ``F8B0_W8_M-1_MC-1_R0.08_T0`` (``T2`` = TaylorSeer order 2)."""
    t = s.taylorseer_order if s.taylorseer else 0
    return (
        f"F{s.Fn}B{s.Bn}_W{s.max_warmup_steps}_M{s.max_cached_steps}_"
        f"MC{s.max_continuous_cached_steps}_R{s.residual_diff_threshold}_T{t}"
    )


@define(eq=False)
class _ContextHandle:
    manager: OmniloopContextManager
    name: str
    finalizer: Any = None


@define(eq=False)
class CacheDiTState:
    """Per-(request, branch) state returned by :meth:`CacheDiTInterceptor.open`."""

    key: str
    branch: str
    settings: CacheDiTConfig
    num_inference_steps: int | None
    #: cache-dit contexts of this branch, by block-list key (one per transformer that ran)
    contexts: dict[tuple[int, ...], _ContextHandle] = field(factory=dict)
    #: loop step indices (``StepContext.step_index``) whose middle blocks were skipped
    cached_steps: list[int] = field(factory=list)
    #: loop step index -> relative L1 change of the Fn residual (absent during warmup).
    #: cache-dit's sentinels: -0.0 threshold disabled, -1.0 threshold >= 1, -2.0 shape changed.
    residual_diffs: dict[int, float] = field(factory=dict)
    forwards: int = 0
    closed: bool = False


class _ManagerRegistry:
    """One manager per block list, keyed by the identity of the block modules.

    Keyed by the ids of the blocks (not of the container), so a family may pass ``self.blocks``
    or a fresh list/slice of the same modules. The registry keeps the blocks alive with it.
    """

    def __init__(self, process_group: Any) -> None:
        self._lock = threading.Lock()
        self._managers: dict[tuple[int, ...], tuple[tuple[Any, ...], OmniloopContextManager]] = {}
        self.process_group = process_group

    def get(self, blocks: Sequence[Any]) -> tuple[tuple[int, ...], OmniloopContextManager]:
        key = tuple(id(b) for b in blocks)
        entry = self._managers.get(key)
        if entry is None:
            with self._lock:
                entry = self._managers.get(key)
                if entry is None:
                    mgr = OmniloopContextManager(
                        name=f"omniloop-cache-dit-{len(self._managers)}", process_group=self.process_group
                    )
                    entry = (tuple(blocks), mgr)
                    self._managers[key] = entry
        return key, entry[1]

    def managers(self) -> list[OmniloopContextManager]:
        return [m for _, m in self._managers.values()]

    def set_group(self, group: Any) -> None:
        self.process_group = group
        for mgr in self.managers():
            mgr.process_group = group


class CacheDiTInterceptor:
    """DBCache / TaylorSeer from cache-dit, one context per (request, guidance branch)."""

    name = NAME
    #: the request-parameter schema (``plugin_params["cache-dit"]``), as registered
    params_schema = CacheDiTParams
    graph_safe = False  # host-side decision with a .item() sync per forward
    distribution_altering = True  # outputs differ from the uncached model: refused for exact requests
    needs_eager = False  # the blocks may be compiled; only this wrapper stays in Python

    def __init__(self, config: CacheDiTConfig | dict[str, Any] | None = None, *, process_group: Any = None) -> None:
        _cachedit.check_version()
        try:
            cfg = structure_config(CacheDiTConfig, config, f"plugins.{NAME}")
        except RequestError as exc:
            raise DeployError(f"deploy config: {exc}") from None
        self.config: CacheDiTConfig = cfg
        self._registry = _ManagerRegistry(process_group)
        self._seq = itertools.count()

    # ---------------------------------------------------------------------------------------
    # wiring the runtime does once
    # ---------------------------------------------------------------------------------------

    def bind_process_group(self, group: Any) -> None:
        """Reduce the cache decision over ``group`` (the pool's sequence-parallel group).

        Call before the first request when the transformer runs sequence-parallel; ``None`` (the
        default) never reduces. With ``torch.distributed`` not initialized nothing is reduced.
        """
        self._registry.set_group(group)

    @property
    def process_group(self) -> Any:
        return self._registry.process_group

    # ---------------------------------------------------------------------------------------
    # BlockInterceptor protocol
    # ---------------------------------------------------------------------------------------

    def open(self, step: StepContext, loop: LoopState, params: CacheDiTParams | None = None) -> CacheDiTState:
        """Resolve this request's settings and allocate the branch's state.

        ``params`` is the request's ``plugin_params["cache-dit"]``, validated once by the runtime
        against :class:`CacheDiTParams` (None: the deploy's settings)."""
        settings = resolve(self.config, params)
        branch = step.branch or "cond"
        num_steps = step.num_steps or loop.total or None
        key = f"{step.request_id}/{step.node}/{branch}#{next(self._seq)}"
        return CacheDiTState(key=key, branch=branch, settings=settings, num_inference_steps=num_steps)

    def run(self, blocks: Sequence[Any], hidden: torch.Tensor, ctx: BlockContext, call: BlockCall) -> torch.Tensor:
        state = ctx.state
        if not isinstance(state, CacheDiTState):
            raise PluginError(
                f"{NAME}: no state for request {ctx.step.request_id!r} branch {ctx.step.branch!r}; "
                "the runtime must call open() for every guidance branch before the first step"
            )
        if state.closed:
            raise PluginError(f"{NAME}: state {state.key!r} was used after close()")
        s = state.settings
        n = len(blocks)
        if s.Fn + s.Bn > n:
            raise PluginError(f"{NAME}: Fn ({s.Fn}) + Bn ({s.Bn}) exceeds the {n} blocks of this transformer")
        handle = self._context(state, blocks)
        mgr, cname = handle.manager, handle.name
        state.forwards += 1

        # 1. first Fn blocks
        hidden_in = hidden
        for block in blocks[: s.Fn]:
            hidden = call(block, hidden)
        fn_res = hidden - hidden_in
        del hidden_in

        # 2. the decision (cache-dit's bookkeeping, under the manager lock)
        with mgr.selected(cname):
            mgr.mark_step_begin()
            hit = bool(mgr.can_cache(fn_res, parallelized=False, prefix=_cachedit.FN_PREFIX))
            diff = mgr.get_current_step_residual_diff()
            if hit:
                mgr.add_cached_step()
                prefix = _cachedit.BN_RESIDUAL_PREFIX if mgr.is_cache_residual() else _cachedit.BN_HIDDEN_PREFIX
                hidden, _ = mgr.apply_cache(hidden, None, prefix=prefix)
            else:
                mgr.set_Fn_buffer(fn_res, prefix=_cachedit.FN_PREFIX)
        del fn_res
        if diff is not None:
            state.residual_diffs[ctx.step.step_index] = float(diff)

        # 3. middle blocks on a miss, and their residual (or output) stored for later hits
        if hit:
            state.cached_steps.append(ctx.step.step_index)
        else:
            mid_in = hidden
            for block in blocks[s.Fn : n - s.Bn]:
                hidden = call(block, hidden)
            hidden = hidden.contiguous()
            with mgr.selected(cname):
                if mgr.is_cache_residual():
                    mgr.set_Bn_buffer(hidden - mid_in, prefix=_cachedit.BN_RESIDUAL_PREFIX)
                else:
                    mgr.set_Bn_buffer(hidden, prefix=_cachedit.BN_HIDDEN_PREFIX)
            del mid_in

        # 4. last Bn blocks always run
        for block in blocks[n - s.Bn :] if s.Bn else ():
            hidden = call(block, hidden)
        return hidden

    def close(self, state: Any) -> None:
        """Remove this branch's cache-dit contexts (and their buffers). Idempotent."""
        if not isinstance(state, CacheDiTState) or state.closed:
            return
        state.closed = True
        for handle in state.contexts.values():
            if handle.finalizer is not None:
                handle.finalizer.detach()
            with handle.manager.lock:
                handle.manager.remove_context(handle.name)
        state.contexts.clear()

    def metrics(self, state: Any) -> dict[str, Any]:
        """Stats of one (request, branch); valid before and after ``close``."""
        if not isinstance(state, CacheDiTState):
            return {}
        computed = state.forwards - len(state.cached_steps)
        return {
            "branch": state.branch,
            "settings": settings_tag(state.settings),
            "forwards": state.forwards,
            "computed_steps": computed,
            "num_cached_steps": len(state.cached_steps),
            "cached_steps": list(state.cached_steps),
            "cache_ratio": (len(state.cached_steps) / state.forwards) if state.forwards else 0.0,
            "residual_diffs": {str(k): v for k, v in state.residual_diffs.items()},
        }

    # ---------------------------------------------------------------------------------------

    def _context(self, state: CacheDiTState, blocks: Sequence[Any]) -> _ContextHandle:
        key, mgr = self._registry.get(blocks)
        handle = state.contexts.get(key)
        if handle is not None:
            return handle
        name = f"{state.key}@{mgr.name}"
        with mgr.lock:
            mgr.new_context(
                name=name,
                cache_config=self._cache_config(state),
                calibrator_config=self._calibrator_config(state.settings),
            )
        handle = _ContextHandle(manager=mgr, name=name)
        # Safety net: a state dropped without close() (a runtime bug) still frees its buffers.
        handle.finalizer = weakref.finalize(state, _remove_context, mgr, name)
        state.contexts[key] = handle
        return handle

    @staticmethod
    def _cache_config(state: CacheDiTState) -> Any:
        s = state.settings
        return _cachedit.DBCacheConfig(
            Fn_compute_blocks=s.Fn,
            Bn_compute_blocks=s.Bn,
            residual_diff_threshold=float(s.residual_diff_threshold),
            max_warmup_steps=s.max_warmup_steps,
            max_cached_steps=s.max_cached_steps,
            max_continuous_cached_steps=s.max_continuous_cached_steps,
            # each branch is its own context and counts its own steps
            enable_separate_cfg=False,
            num_inference_steps=state.num_inference_steps,
        )

    @staticmethod
    def _calibrator_config(s: CacheDiTConfig) -> Any:
        if not s.taylorseer:
            return None
        return _cachedit.TaylorSeerCalibratorConfig(
            enable_calibrator=True,
            # the block stack carries no separate encoder stream through run_blocks
            enable_encoder_calibrator=False,
            calibrator_cache_type="residual",
            taylorseer_order=s.taylorseer_order,
        )

    def __repr__(self) -> str:
        return f"CacheDiTInterceptor({settings_tag(self.config)}, sp={group_is_active(self.process_group)})"


def _remove_context(mgr: OmniloopContextManager, name: str) -> None:
    with mgr.lock:
        mgr.remove_context(name)


__all__ = ["NAME", "CacheDiTInterceptor", "CacheDiTParams", "CacheDiTState", "settings_tag"]
