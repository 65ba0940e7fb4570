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

from .denoise import _check_index, _note_expert, split_rows, stack_inputs

if TYPE_CHECKING:
    from .denoise import Denoise


def _pure_plan(pol: Any, step: Any, loop: LoopState) -> tuple[str, ...] | None:
    """This step's branches for CFG policies whose plan depends only on the step, else None."""
    from omniloop_policies import ClassicCFG, IntervalCFG

    cfg = pol.cfg
    state = pol.cfg_state(loop)
    both = ("cond", "uncond")
    if type(cfg) is ClassicCFG:
        return both if state.enabled else ("cond",)
    if type(cfg) is IntervalCFG:
        return both if state.enabled and cfg.in_window(step) else ("cond",)
    return None


def _shape(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    return None if t is None else (tuple(t.shape), str(t.dtype), str(t.device))


def batch_key(stage: Denoise, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
    """Equal for requests whose next step may run as one batched forward, else None."""
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
    plan = _pure_plan(pol, step, loop)
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
    from omniloop_policies import forward_groups

    if not loops:
        return []
    ctx0 = ctxs[0]
    pols = [lp.policy_state["policies"] for lp in loops]
    steps = [
        pol.step_context(lp, request_id=st.request.request_id, node=ctx.node.name)
        for pol, lp, st, ctx in zip(pols, loops, states, ctxs, strict=True)
    ]
    for lp, s in zip(loops, steps, strict=True):
        _check_index(lp, s)
    experts = {s.expert for s in steps}
    if len(experts) != 1:
        raise RuntimeError(f"step_batch: requests route to different experts {sorted(map(str, experts))}")
    expert = steps[0].expert
    assert expert is not None
    plans = [pol.plan(s, lp) for pol, s, lp in zip(pols, steps, loops, strict=True)]
    if len(set(plans)) != 1:
        raise RuntimeError(f"step_batch: requests plan different branches {plans}")
    dtype = pols[0].precision.dtype_for(expert)
    results: list[StepResult] = []
    with torch.no_grad():
        inputs = [
            stage.step_inputs(st, lp.tensors["latents"], pol.timestep(lp), dtype)
            for st, lp, pol in zip(states, loops, pols, strict=True)
        ]
        preds: list[dict[str, torch.Tensor]] = [{} for _ in loops]
        for group in forward_groups(pols[0].cfg, plans[0]):
            out = stage.forward(ctx0, expert, stack_inputs(inputs, group), None)
            for mine, parts in zip(preds, split_rows(out, inputs, group), strict=True):
                mine.update(parts)
        for pol, s, lp, mine in zip(pols, steps, loops, preds, strict=True):
            guided = pol.combine(s, lp, mine)
            lp.tensors["latents"] = pol.advance(s, lp, guided, lp.tensors["latents"])
            _note_expert(lp, expert)
            results.append(StepResult(done=pol.done(lp)))
    return results


__all__ = ["batch_key", "step_batch"]
