"""The skeleton of a diffusers-format family's ``denoise`` node on omniloop-policies: one solver step
per ``step()``, batched steps across requests (``batch_key`` / ``step_batch``), the finalize.

A family subclasses :class:`DenoiseLoop` and writes what is its own — ``init`` (its latents and
the policies' per-request state), ``inputs`` (its model inputs at one step), ``stack`` (how one
forward's rows are stacked; :func:`omniloop_policies.stepping.stack_rows`), ``forward`` (its
transformer; or only ``model_forward``, its outer forward, which the default ``forward`` runs with
the compiled blocks and CUDA graphs) and ``key`` (what else must match for two requests to share a forward) — and the
skeleton orders the calls the way every family did::

    pol, step = begin_step(...)                 # step context, index checked
    inp = self.inputs(ctx, state, loop, pol, step.expert)
    preds = one forward per group of self.groups(pol, step, loop), through the step interceptors
    finish_step(...)                            # the CFG combine, the sampler step, taps

The skeleton does no arithmetic of its own, so a family keeps its diffusers parity bit for bit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from omniloop.artifacts import Latents
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, RequestState, StepResult

from .compile import blocks_for, compile_info
from .graphs import graphed


def request_generator(state: RequestState) -> torch.Generator:
    """The request's generator; driven without a runtime, one seeded from ``diffusion.seed`` (still
    deterministic per request)."""
    if state.generator is not None:
        return state.generator
    return torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))


def randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    """diffusers' ``randn_tensor``: drawn on the generator's device in ``dtype``, then moved."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def step_time_metrics(ctx: StageContext, state: RequestState) -> dict[str, Any] | None:
    """The first step's seconds apart from the steady median of the rest (the first holds the
    loop's set-up and, with compiled blocks, compilation) and the compile info; None without steps."""
    times = state.metrics.get("step_seconds")
    if not times:
        return None
    out: dict[str, Any] = {"first_step_seconds": times[0]}
    if len(times) > 1:
        out["steady_step_seconds"] = round(statistics.median(times[1:]), 6)
    info = compile_info(ctx)
    if info is not None:
        out["compile"] = info
    return out


def note_expert(loop: LoopState, expert: str | None) -> None:
    """Record the expert a step ran on (``metrics["experts"]``: the sequence of experts used)."""
    used = loop.extra.setdefault("experts_used", [])
    if expert is not None and (not used or used[-1] != expert):
        used.append(expert)


def shape_of(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """A tensor's shape, dtype and device (for a batch key); None for None."""
    return None if t is None else (tuple(t.shape), str(t.dtype), str(t.device))


class DenoiseLoop:
    """The denoise node's skeleton (see the module docstring)."""

    #: the batch key's first element (a family's keys never match another's)
    tag = "denoise"
    #: the artifact modality of the ``denoised`` edge
    modality = "image"
    #: with policy names in ``metrics["policies"]`` (the menu's names of the sampler and CFG policy)
    name_policies = True

    def __init__(self, menu: Any) -> None:
        self.menu = menu

    # -- what the family writes -----------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        raise NotImplementedError

    def inputs(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, expert: str | None) -> Any:
        """One request's model inputs at this step."""
        raise NotImplementedError

    def stack(self, inputs: Sequence[Any], group: tuple[str, ...]) -> dict[str, Any]:
        """The stacked batch of one forward computing ``group`` for ``inputs`` (request-major)."""
        raise NotImplementedError

    def rows(self, inputs: Any) -> int:
        """Batch rows of one request's inputs."""
        raise NotImplementedError

    #: the family's outer forward ``fn(model, block_ctx=..., blocks=..., **batch)`` on its
    #: ``transformer`` (a ``staticmethod``), for the default :meth:`forward`
    model_forward: Callable[..., torch.Tensor] | None = None

    def forward(self, ctx: StageContext, expert: str, batch: dict[str, Any], block_ctx: BlockContext | None) -> torch.Tensor:
        """``batch`` through :attr:`model_forward`, with the transformer's compiled blocks when deploy
        ``compile`` compiled them (:func:`~omniloop_kit.compile.blocks_for`), replayed as one CUDA
        graph with ``options.cuda_graphs`` when nothing is bound per block (:mod:`omniloop_kit.graphs`)."""
        fn = self.model_forward
        if fn is None:
            raise NotImplementedError(f"{type(self).__name__} declares no model_forward and writes no forward")
        model = ctx.components["transformer"]
        blocks = blocks_for(model, ctx)

        def run(bctx: BlockContext | None, **inputs: Any) -> torch.Tensor:
            return fn(model, block_ctx=bctx, blocks=blocks, **inputs)

        return graphed(ctx, block_ctx, model, blocks is not None, run, batch)

    def key(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, step: Any) -> Hashable:
        """What else must match for this request's step to share a forward (text shapes, scales, ...)."""
        return ()

    # -- what a family may change ---------------------------------------------------------------
    def groups(self, pol: Any, plan: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """The forwards of a plan (the CFG policy's: a ``batched`` policy stacks its branches)."""
        from omniloop_policies import forward_groups

        return forward_groups(pol.cfg, plan)

    def plan_of(self, pol: Any, step: Any, loop: LoopState) -> tuple[str, ...] | None:
        """The branches the next step computes, known without planning; None: not batchable."""
        from omniloop_policies.stepping import peek_plan

        return peek_plan(pol, step, loop)

    def prefix(self, expert: str | None) -> str:
        """Where the block context's names start (``<expert>.blocks``)."""
        return f"{expert or 'transformer'}.blocks"

    def split(self, out: torch.Tensor, inputs: Sequence[Any], group: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        """Undo :meth:`stack` on a prediction: per request, ``{branch: prediction}``."""
        from omniloop_policies.stepping import unstack_rows

        return unstack_rows(out, [self.rows(inp) for inp in inputs], group)

    def final_latents(self, ctx: StageContext, state: RequestState, loop: LoopState) -> torch.Tensor:
        return loop.tensors["latents"]

    def denoise_metrics(self, ctx: StageContext, state: RequestState) -> dict[str, Any] | None:
        return step_time_metrics(ctx, state)

    def release(self, loop: LoopState) -> None:
        """Drop the request's scheduler instance (with its multistep history) and CFG caches."""
        loop.policy_state.pop("sampler", None)
        loop.policy_state.pop("cfg", None)

    def note(self, loop: LoopState, expert: str | None) -> None:
        """Called with each step's expert (a family with several experts records them)."""

    # -- the skeleton ---------------------------------------------------------------------------
    def policy_names(self, pol: Any) -> dict[str, str]:
        """The menu names of a request's sampler and CFG policy (:func:`omniloop_policies.stepping.policy_names`)."""
        from omniloop_policies.stepping import policy_names

        return policy_names(self.menu, pol)

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        from omniloop_policies.stepping import begin_step, branch_predictions, finish_step

        pol, step = begin_step(ctx, state, loop)
        expert = step.expert
        self.note(loop, expert)
        with torch.no_grad():
            inp = self.inputs(ctx, state, loop, pol, expert)
            preds = branch_predictions(
                ctx, step, loop, self.groups(pol, tuple(pol.plan(step, loop))),
                batch=lambda group: self.stack([inp], group),
                forward=lambda batch, bctx: self.forward(ctx, expert, batch, bctx),
                split=lambda out, group: self.split(out, [inp], group)[0],
                prefix=self.prefix(expert),
            )
        return finish_step(ctx, pol, step, loop, preds)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        latents = self.final_latents(ctx, state, loop)
        pol = loop.policy_state.get("policies")
        if pol is not None:
            names = self.policy_names(pol) if self.name_policies else {}
            state.metrics["policies"] = {**pol.metrics(loop), **names}
        metrics = self.denoise_metrics(ctx, state)
        if metrics is not None:
            state.metrics["denoise"] = metrics
        state.write("denoised", Latents(tensor=latents, modality=self.modality), ctx.node.name)
        self.release(loop)

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        """Equal for requests whose next step may run as one stacked forward, else None.

        Not batched: a bound interceptor, taps, ``exact`` requests (a stacked batch changes GEMM
        shapes, so the last bits differ from running alone), a plan not known ahead (CFG policies
        whose plan depends on per-request cached state), or the family's ``key`` says None."""
        from omniloop_policies.stepping import batchable

        got = batchable(ctx, state, loop)
        if got is None:
            return None
        pol, step = got
        plan = self.plan_of(pol, step, loop)
        if plan is None:
            return None
        own = self.key(ctx, state, loop, pol, step)
        if own is None:
            return None
        names = self.policy_names(pol)
        return (self.tag, step.expert, shape_of(loop.tensors["latents"]), step.step_index, step.num_steps,
                step.timestep, names["sampler"], names["cfg"], plan, own)

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        """One step of every request: one forward per group over all of them, then each request's
        own combine and scheduler step (no taps: batched steps run without observers)."""
        from omniloop_policies.stepping import begin_steps, finish_step, plan_together

        if not loops:
            return []
        pols, steps = begin_steps(ctxs, states, loops)
        experts = {s.expert for s in steps}
        if len(experts) != 1:
            raise RuntimeError(f"step_batch: requests route to different experts {sorted(map(str, experts))}")
        expert = steps[0].expert
        plan = plan_together(pols, steps, loops)
        with torch.no_grad():
            inputs = [self.inputs(c, st, lp, pol, expert)
                      for c, st, lp, pol in zip(ctxs, states, loops, pols, strict=True)]
            preds: list[dict[str, torch.Tensor]] = [{} for _ in loops]
            for group in self.groups(pols[0], plan):
                out = self.forward(ctxs[0], expert, self.stack(inputs, group), None)
                for mine, parts in zip(preds, self.split(out, inputs, group), strict=True):
                    mine.update(parts)
        results = []
        for pol, s, lp, mine in zip(pols, steps, loops, preds, strict=True):
            self.note(lp, expert)
            results.append(finish_step(None, pol, s, lp, mine))
        return results


__all__ = ["DenoiseLoop", "note_expert", "randn", "request_generator", "shape_of", "step_time_metrics"]
