"""The body of a family's denoise ``step()`` on the policies, with per-forward inputs and taps.

:meth:`DenoisePolicies.predict` runs plan → forwards → combine in one call. A family that wants
its step interceptors to see the inputs *of each forward* (the stacked batch of a batched CFG
group), a block context per forward and a tap of every branch's prediction calls the pieces
instead; these helpers are those pieces, shared by the Wan, SD3 and Flux families::

    pol, step = begin_step(ctx, state, loop)          # step context, index checked
    with torch.no_grad():
        inp = ...                                      # the family's model inputs at this step
        preds = branch_predictions(
            ctx, step, loop, forward_groups(pol.cfg, pol.plan(step, loop)),
            batch=lambda group: stack(inp, group),     # the family's stacking (row order is its own)
            forward=lambda batch, bctx: my_forward(batch, bctx),
            split=lambda out, group: unstack(out, group),   # {branch: prediction}
            prefix="transformer.blocks",
        )
    return finish_step(ctx, pol, step, loop, preds)   # combine, advance, taps, StepResult

For a batched CFG group, or several requests in one forward, :func:`stack_rows` concatenates the
inputs request-major, then branch by branch in the order given (``[(r0, b0), (r0, b1), (r1, b0),
...]``), and :func:`unstack_rows` splits a prediction back the same way; with one request and one
branch both pass the tensors through untouched (no copy).

Batched steps across requests (a family's ``batch_key`` / ``step_batch``): :func:`batchable` says
whether a request's next step may join one (and gives its policies and step context),
:func:`peek_plan` the branches it will compute without counting them (for the key),
:func:`begin_steps` / :func:`plan_together` start the batched step; each request then ends with
:func:`finish_step` (``ctx=None``: no taps in a batched step).

The helpers only order calls the family would make itself — no arithmetic of their own — so a
family keeps its diffusers parity bit for bit: the CFG formula is the policy's ``combine``, the
stacking and splitting of a batched group are the family's (SD3 stacks ``uncond`` first, as
diffusers' pipeline does; Wan in plan order).

Taps (when an observer listens): ``noise_pred`` per branch right after its forward (branch set on
the step), ``guided`` after the combine, ``latents`` after the sampler step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from omniloop.interceptors import BlockContext, call_model
from omniloop.loop import LoopState, StepContext, StepResult
from omniloop.rl import ROLLOUT_KEY

from .cfg import ClassicCFG, IntervalCFG, Prediction, forward_name

#: ``batch(group) -> the inputs of one model forward computing ``group`` (what step interceptors see)``
BatchFor = Callable[[tuple[str, ...]], dict[str, Any]]
#: ``forward(batch, block_ctx) -> prediction`` (stacked along dim 0 for a group of several branches)
ForwardFn = Callable[[dict[str, Any], BlockContext | None], torch.Tensor]
#: ``split(prediction, group) -> {branch: prediction}``
SplitFn = Callable[[torch.Tensor, tuple[str, ...]], Mapping[str, torch.Tensor]]

__all__ = [
    "batchable",
    "begin_step",
    "begin_steps",
    "branch_predictions",
    "check_index",
    "finish_step",
    "peek_plan",
    "plan_together",
    "policy_names",
    "stack_rows",
    "unstack_rows",
]


def check_index(loop: LoopState, step: StepContext) -> None:
    """The sampler's step index must equal the runtime's ``loop.step`` (a stage never advances it)."""
    if step.step_index != loop.step:
        raise RuntimeError(
            f"node {step.node!r}: the sampler is at step {step.step_index} but the loop at {loop.step}; "
            "loop.step is advanced by the runtime after step() returns, never by the stage"
        )


def begin_step(ctx: Any, state: Any, loop: LoopState) -> tuple[Any, StepContext]:
    """The request's :class:`~omniloop_policies.DenoisePolicies` and this step's context (index checked)."""
    pol = loop.policy_state["policies"]
    step = pol.step_context(loop, request_id=state.request.request_id, node=ctx.node.name)
    check_index(loop, step)
    return pol, step


def branch_predictions(
    ctx: Any,
    step: StepContext,
    loop: LoopState,
    groups: Iterable[tuple[str, ...]],
    *,
    batch: BatchFor,
    forward: ForwardFn,
    split: SplitFn,
    prefix: str,
) -> dict[str, torch.Tensor]:
    """One model forward per group, each through the step interceptors with ``step.branch`` set to
    the group's forward name and a block context under ``prefix``; the predictions by branch."""
    taps = ctx.taps_enabled
    preds: dict[str, torch.Tensor] = {}
    for group in groups:
        sc = step.with_branch(forward_name(group))
        inputs = batch(group)
        bctx = ctx.block_context(sc, loop, prefix=prefix)

        def compute(inputs: dict[str, Any] = inputs, bctx: BlockContext | None = bctx) -> torch.Tensor:
            return forward(inputs, bctx)

        out = call_model(ctx.step_interceptors, sc, loop, inputs, compute)
        for b, pred in split(out, group).items():
            preds[b] = pred
            if taps:
                ctx.tap("noise_pred", pred, step.with_branch(b))
    return preds


def finish_step(ctx: Any, pol: Any, step: StepContext, loop: LoopState, preds: Mapping[str, Prediction]) -> StepResult:
    """Combine the branch predictions (the CFG policy), take the sampler step on
    ``loop.tensors["latents"]`` — or, on a rollout request (``loop.extra["rollout"]``, installed by
    the runtime), the rollout step of :mod:`omniloop_policies.rollout` on the sampler's schedule — store the new
    latents; taps when an observer listens.

    ``ctx`` may be None (batched steps across requests run without taps)."""
    taps = ctx is not None and ctx.taps_enabled
    with torch.no_grad():
        guided = pol.combine(step, loop, preds)
        if taps:
            ctx.tap("guided", guided, step)
        rollout = loop.extra.get(ROLLOUT_KEY)
        if rollout is None:
            latents = pol.advance(step, loop, guided, loop.tensors["latents"])
        else:  # a post-training rollout: the rollout step (omniloop_policies.rollout) on the sampler's schedule
            latents = pol.advance_rollout(step, loop, guided, loop.tensors["latents"], rollout)
    loop.tensors["latents"] = latents
    if taps:
        ctx.tap("latents", latents, step)
    return StepResult(done=pol.done(loop))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def stack_rows(
    inputs: Sequence[Any], group: Sequence[str], row: Callable[[Any, str], Mapping[str, torch.Tensor | None]]
) -> dict[str, torch.Tensor | None]:
    """The stacked inputs of one forward: ``row(request_inputs, branch)`` gives one row block's
    tensors by name; each name is concatenated along dim 0, request-major, then in ``group``
    order. A name that is None in every row block stays None (an optional input)."""
    parts: dict[str, list[torch.Tensor]] = {}
    absent: set[str] = set()
    for inp in inputs:
        for b in group:
            for name, value in row(inp, b).items():
                if value is None:
                    absent.add(name)
                else:
                    parts.setdefault(name, []).append(value)
    mixed = sorted(absent & parts.keys())
    if mixed:
        raise ValueError(f"stack_rows: {mixed[0]!r} is None for some rows and a tensor for others")
    out: dict[str, torch.Tensor | None] = {name: _cat(p) for name, p in parts.items()}
    out.update(dict.fromkeys(absent))
    return out


def unstack_rows(out: torch.Tensor, rows: Sequence[int], group: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """Undo :func:`stack_rows` on a prediction. ``rows``: each request's batch rows (dim 0 of its
    inputs); returns per request ``{branch: prediction}`` (views of ``out``)."""
    sizes = [n for n in rows for _ in group]
    chunks = torch.split(out, sizes, dim=0) if len(sizes) > 1 else (out,)
    it = iter(chunks)
    return [{b: next(it) for b in group} for _ in rows]


# -- batched steps across requests ---------------------------------------------------------------


def batchable(ctx: Any, state: Any, loop: LoopState) -> tuple[Any, StepContext] | None:
    """``(policies, step context)`` when this request's next step may run in one forward with
    other requests', else None: not with a bound block or step interceptor or any taps (they watch
    one request's forward), not for ``exact`` requests (a stacked batch changes GEMM shapes, so the
    last bits differ from running alone), not when the loop is done or the sampler and
    ``loop.step`` disagree."""
    if ctx.block_interceptor is not None or ctx.step_interceptors or ctx.block_taps is not None or ctx.taps_enabled:
        return None
    if state.request.exact:
        return None
    pol = loop.policy_state.get("policies")
    if pol is None or pol.done(loop):
        return None
    step = pol.step_context(loop, request_id=state.request.request_id, node=ctx.node.name)
    if step.step_index != loop.step:
        return None
    return pol, step


def peek_plan(pol: Any, step: StepContext, loop: LoopState) -> tuple[str, ...] | None:
    """The branches ``pol.plan`` will return at this step, without planning (policies count their
    plans), for CFG policies whose plan depends on the step alone — ``classic`` (and ``batched``)
    and ``interval``; None for the others (their plan reads per-request cached state)."""
    cfg, cstate = pol.cfg, pol.cfg_state(loop)
    if type(cfg) is ClassicCFG:
        return ("cond", "uncond") if cstate.enabled else ("cond",)
    if type(cfg) is IntervalCFG:
        return ("cond", "uncond") if cstate.enabled and cfg.in_window(step) else ("cond",)
    return None


def begin_steps(ctxs: Sequence[Any], states: Sequence[Any], loops: Sequence[LoopState]) -> tuple[list[Any], list[StepContext]]:
    """:func:`begin_step` for every request of a batched step: their policies and step contexts."""
    pols = [lp.policy_state["policies"] for lp in loops]
    steps = [pol.step_context(lp, request_id=st.request.request_id, node=c.node.name)
             for pol, lp, st, c in zip(pols, loops, states, ctxs, strict=True)]
    for lp, s in zip(loops, steps, strict=True):
        check_index(lp, s)
    return pols, steps


def plan_together(pols: Sequence[Any], steps: Sequence[StepContext], loops: Sequence[LoopState]) -> tuple[str, ...]:
    """Plan every request's step (once each: policies count it); they must plan the same branches."""
    plans = [tuple(pol.plan(s, lp)) for pol, s, lp in zip(pols, steps, loops, strict=True)]
    if len(set(plans)) != 1:
        raise RuntimeError(f"step_batch: requests plan different branches {plans}")
    return plans[0]


def policy_names(menu: Any, pol: Any) -> dict[str, str]:
    """The menu names of a request's sampler and CFG policy, for metrics and batch keys (``batched``
    is ``ClassicCFG(batched=True)``, whose class name is ``classic``): the entry holding that very
    object, else an equal one, else the policy's own name."""
    out = {}
    for role, table in (("sampler", menu.samplers), ("cfg", menu.cfgs)):
        obj = getattr(pol, role)
        out[role] = next((k for k, v in table.items() if v is obj), None) or next(
            (k for k, v in table.items() if v == obj), obj.name
        )
    return out
