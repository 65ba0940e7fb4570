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

from .cfg import Prediction, forward_name

#: ``batch(group) -> the inputs of one model forward computing ``group`` (what step interceptors see)``
BatchFor = Callable[[tuple[str, ...]], dict[str, Any]]
#: ``forward(batch, block_ctx) -> prediction`` (stacked along dim 0 for a group of several branches)
ForwardFn = Callable[[dict[str, Any], BlockContext | None], torch.Tensor]
#: ``split(prediction, group) -> {branch: prediction}``
SplitFn = Callable[[torch.Tensor, tuple[str, ...]], Mapping[str, torch.Tensor]]

__all__ = ["begin_step", "branch_predictions", "check_index", "finish_step", "stack_rows", "unstack_rows"]


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
    ``loop.tensors["latents"]``, store the new latents; taps when an observer listens.

    ``ctx`` may be None (batched steps across requests run without taps)."""
    taps = ctx is not None and ctx.taps_enabled
    with torch.no_grad():
        guided = pol.combine(step, loop, preds)
        if taps:
            ctx.tap("guided", guided, step)
        latents = pol.advance(step, loop, guided, loop.tensors["latents"])
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
    chunks = out.split(sizes, dim=0) if len(sizes) > 1 else (out,)
    it = iter(chunks)
    return [{b: next(it) for b in group} for _ in rows]
