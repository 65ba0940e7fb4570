"""Batched denoise steps across requests (``Denoise.batch_key`` / ``Denoise.step_batch``).

The step scheduler co-batches executions whose ``batch_key`` is equal: their next step runs as
one transformer forward per forward group over the stacked batch, then each request combines
its own predictions with its own CFG state and steps its *own* scheduler instance.

What must match (the key): the expert (same transformer), latent shape / dtype / device, the
model-input layout (I2V condition, CLIP states, per-token timesteps), the text-embedding shapes
(Wan pads every prompt to 512 tokens, so different prompts stack as they are: the model sees
exactly the rows it would see alone), the step index, timestep and step count, the sampler, the
CFG policy (by menu name: ``batched`` stacks cond+uncond too), this step's plan, and the
guidance scale of this step.

Not batched (key None): a block or step interceptor is bound, block taps or taps are on (they
are per request and per forward), the request is ``exact`` (a stacked batch changes the GEMM
shapes, so results differ from running alone in the last bits), or the CFG policy's plan depends
on per-request cached state (``adaptive-gate``: its delta cache; ``guider``) — only ``classic``,
``batched`` and ``interval`` (whose plan is a function of the step) are batched.

Tolerance: results equal each request run alone up to float reassociation of the stacked
forward (tests/wan/test_batching.py states the measured figures).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from omniloop.artifacts import Embeddings, Tensors
from omniloop.context import StageContext
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop_policies import forward_groups
from omniloop_policies.stepping import batchable, begin_steps, finish_step, peek_plan, plan_together

from .denoise import _note_expert, split_rows, stack_inputs

if TYPE_CHECKING:
    from .denoise import Denoise


def _shape(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    return None if t is None else (tuple(t.shape), str(t.dtype), str(t.device))


def batch_key(stage: Denoise, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
    """Equal for requests whose next step may run as one batched forward, else None."""
    got = batchable(ctx, state, loop)
    if got is None:
        return None
    pol, step = got
    plan = peek_plan(pol, step, loop)
    if plan is None:
        return None
    names = stage.policy_names(pol)
    cond = state.get("image_cond")
    values = cond.values if isinstance(cond, Tensors) else {}
    image = tuple(sorted((k, _shape(v)) for k, v in values.items()))
    text = tuple(_shape(state.read(e, Embeddings).tensor) for e in ("prompt_embeds", "negative_embeds"))
    return (
        "wan-denoise",
        step.expert,
        _shape(loop.tensors["latents"]),
        image,
        text,
        step.step_index,
        step.num_steps,
        step.timestep,
        names["sampler"],
        names["cfg"],
        plan,
        float(pol.cfg_state(loop).scale_for(step)),
        str(pol.precision.dtype_for(step.expert)),
    )


def step_batch(
    stage: Denoise, ctxs: Sequence[StageContext], states: Sequence[RequestState], loops: Sequence[LoopState]
) -> list[StepResult]:
    """One step of every request: one forward per forward group over all of them, then each
    request's own combine and scheduler step."""
    if not loops:
        return []
    ctx0 = ctxs[0]
    pols, steps = begin_steps(ctxs, states, loops)
    experts = {s.expert for s in steps}
    if len(experts) != 1:
        raise RuntimeError(f"step_batch: requests route to different experts {sorted(map(str, experts))}")
    expert = steps[0].expert
    assert expert is not None
    plan = plan_together(pols, steps, loops)
    dtype = pols[0].precision.dtype_for(expert)
    with torch.no_grad():
        inputs = [
            stage.step_inputs(st, lp.tensors["latents"], pol.timestep(lp), dtype)
            for st, lp, pol in zip(states, loops, pols, strict=True)
        ]
        preds: list[dict[str, torch.Tensor]] = [{} for _ in loops]
        for group in forward_groups(pols[0].cfg, plan):
            out = stage.forward(ctx0, expert, stack_inputs(inputs, group), None)
            for mine, parts in zip(preds, split_rows(out, inputs, group), strict=True):
                mine.update(parts)
    results: list[StepResult] = []
    for pol, s, lp, mine in zip(pols, steps, loops, preds, strict=True):
        _note_expert(lp, expert)
        results.append(finish_step(None, pol, s, lp, mine))
    return results


__all__ = ["batch_key", "step_batch"]
