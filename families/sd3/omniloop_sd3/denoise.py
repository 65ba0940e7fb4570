"""The ``denoise`` node: one flow-matching step per ``step()``, on omniloop-policies.

``init`` resolves nothing new: the validate node already chose the request's
:class:`omniloop_policies.DenoisePolicies` (sampler, CFG policy, shift, scales). It draws the
initial latents — pure noise for t2i, the noised image latents for i2i — and lets the policies
allocate their per-request state (a fresh scheduler instance, the CFG state). For i2i,
:func:`start_at_strength` then cuts the schedule where diffusers' img2img pipeline starts it.

A step::

    step   = pol.step_context(loop, ...)      # index, host timestep
    plan   = pol.plan(step, loop)             # ("cond", "uncond") with CFG, else ("cond",)
    preds  = one transformer forward per forward group (the default ``batched`` policy stacks
             uncond and cond rows in one forward, uncond first, as diffusers does)
    guided = pol.combine(step, loop, preds)   # uncond + s * (cond - uncond)
    latents = pol.advance(step, loop, guided, latents)

(``omniloop_policies.stepping``: ``begin_step``, ``branch_predictions``, ``finish_step``; SD3's own
parts are its inputs, the uncond-first stacking and the forward.)

Batched steps across requests (the ``step`` scheduler): ``batch_key`` / ``step_batch`` stack every
request's rows into one forward; each request then combines and steps its own scheduler.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop_policies import forward_groups
from omniloop_policies.stepping import (
    batchable,
    begin_step,
    begin_steps,
    branch_predictions,
    finish_step,
    peek_plan,
    plan_together,
    policy_names,
    stack_rows,
    unstack_rows,
)

from .resolve import SD3Params
from .transformer import sd3_forward

#: row order inside a stacked CFG forward: diffusers' ``torch.cat([negative, positive])``
ROW_ORDER = {"uncond": 0, "cond": 1}


def _params(state: RequestState) -> SD3Params:
    return state.read("params", Conditioning).values["params"]


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' ``randn_tensor``: drawn on the generator's device in ``dtype``, then moved."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def start_at_strength(loop: LoopState, strength: float) -> int:
    """Cut the request's schedule as diffusers' img2img ``get_timesteps`` does; returns ``t_start``.

    With ``n`` steps, ``t_start = int(n - min(n * strength, n))``: the sampler state keeps the
    timesteps from ``t_start`` on, its scheduler begins there (``set_begin_index``), and the CFG
    state is rebuilt for the shorter loop. (The policies package has no strength knob; this is the
    family's own, on the policies' public state.)"""
    from omniloop_policies import SamplerState

    pol = loop.policy_state["policies"]
    s: SamplerState = loop.policy_state["sampler"]
    n = s.num_steps
    t_start = int(max(n - min(n * strength, n), 0))
    if t_start == 0:
        return 0
    scheduler = s.scheduler
    order = int(getattr(scheduler, "order", 1))
    scheduler.set_begin_index(t_start * order)
    cut = SamplerState(
        sampler=s.sampler, num_steps=n - t_start, timesteps=s.timesteps[t_start * order:],
        timestep_values=s.timestep_values[t_start * order:], sigma_values=s.sigma_values[t_start * order:],
        scheduler=scheduler, generator=s.generator, tensors=s.tensors,
    )
    loop.policy_state["sampler"] = cut
    cstate = pol.cfg.init(cut.num_steps, scale=pol.guidance_scale, scales_by_expert=pol.scales_by_expert)
    loop.policy_state["cfg"] = cstate
    loop.branches = pol.cfg.branches(cstate)
    loop.total = cut.num_steps
    return t_start


@attrs.define
class StepInputs:
    """One request's model inputs at one step."""

    latents: torch.Tensor
    timestep: torch.Tensor
    #: joint text context / pooled embeddings by branch (``cond`` → prompt, ``uncond`` → negative)
    text: dict[str, torch.Tensor]
    pooled: dict[str, torch.Tensor]


def ordered(group: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(group, key=lambda b: ROW_ORDER.get(b, len(ROW_ORDER))))


def stack_inputs(inputs: Sequence[StepInputs], group: Sequence[str]) -> dict[str, Any]:
    """The stacked batch of one forward: request-major, then the group's branches (uncond first)."""
    return stack_rows(inputs, ordered(group), lambda inp, b: {
        "hidden_states": inp.latents, "timestep": inp.timestep, "encoder_hidden_states": inp.text[b],
        "pooled_projections": inp.pooled[b],
    })


def split_rows(out: torch.Tensor, inputs: Sequence[StepInputs], group: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """Undo :func:`stack_inputs` on a prediction: per request, ``{branch: prediction}``."""
    return unstack_rows(out, [inp.latents.shape[0] for inp in inputs], ordered(group))


class Denoise:
    """One solver step per ``step()``; batched across requests with ``batch_key`` / ``step_batch``."""

    def __init__(self, menu: Any) -> None:
        self.menu = menu

    def policy_names(self, pol: Any) -> dict[str, str]:
        """The menu names of a request's sampler and CFG policy (:func:`omniloop_policies.stepping.policy_names`)."""
        return policy_names(self.menu, pol)

    # -- init ---------------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = _params(state)
        pol = p.policies
        tf, vae = ctx.components["transformer"], ctx.components["vae"]
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        shape = (1, int(tf.config.in_channels), p.height // scale, p.width // scale)
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype  # diffusers: prompt_embeds.dtype
        generator = state.generator
        if generator is None:  # driven without a runtime: still deterministic per request
            generator = torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))
        loop = LoopState()
        patch = int(tf.config.patch_size)
        seq_len = (shape[2] // patch) * (shape[3] // patch)
        if p.strength is None:
            loop.tensors["latents"] = _randn(shape, generator, ctx.device, dtype)
            pol.init(loop, device=ctx.device, generator=generator, seq_len=seq_len)
        else:
            pol.init(loop, device=ctx.device, generator=generator, seq_len=seq_len)
            t_start = start_at_strength(loop, p.strength)
            s = loop.policy_state["sampler"]
            image_latents = state.read("image_latents", Tensors).values["latents"]
            noise = _randn(tuple(image_latents.shape), generator, ctx.device, dtype)
            latent_timestep = s.timesteps[:1].repeat(1)
            latents = s.scheduler.scale_noise(image_latents, latent_timestep, noise)
            loop.tensors["latents"] = latents.to(device=ctx.device, dtype=dtype)
            loop.extra["t_start"] = t_start
        return loop

    # -- inputs / forward ---------------------------------------------------------------------
    def step_inputs(self, state: RequestState, latents: torch.Tensor, t: torch.Tensor) -> StepInputs:
        pos, neg = state.read("prompt_embeds", Embeddings), state.read("negative_embeds", Embeddings)
        return StepInputs(
            latents=latents, timestep=t.expand(latents.shape[0]),
            text={"cond": pos.tensor, "uncond": neg.tensor},
            pooled={"cond": pos.extra["pooled"], "uncond": neg.extra["pooled"]},
        )

    def forward(self, ctx: StageContext, batch: dict[str, Any], block_ctx: BlockContext | None) -> torch.Tensor:
        from .compile import blocks_for

        model = ctx.components["transformer"]
        return sd3_forward(model, batch["hidden_states"], batch["timestep"], batch["encoder_hidden_states"],
                           batch["pooled_projections"], block_ctx, blocks=blocks_for(model, ctx))

    # -- one step -----------------------------------------------------------------------------
    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        pol, step = begin_step(ctx, state, loop)
        with torch.no_grad():
            inp = self.step_inputs(state, loop.tensors["latents"], pol.timestep(loop))
            preds = branch_predictions(
                ctx, step, loop, forward_groups(pol.cfg, pol.plan(step, loop)),
                batch=lambda group: stack_inputs([inp], group),
                forward=lambda batch, bctx: self.forward(ctx, batch, bctx),
                split=lambda out, group: split_rows(out, [inp], group)[0],
                prefix="transformer.transformer_blocks",
            )
        return finish_step(ctx, pol, step, loop, preds)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        pol = loop.policy_state.get("policies")
        if pol is not None:
            state.metrics["policies"] = {**pol.metrics(loop), **self.policy_names(pol)}
        from .compile import blocks_for

        out: dict[str, Any] = {"compiled_blocks": blocks_for(ctx.components["transformer"], ctx) is not None}
        times = state.metrics.get("step_seconds")
        if times:  # the first step holds the loop's set-up and, with compiled blocks, compilation
            out["first_step_seconds"] = times[0]
            if len(times) > 1:
                out["steady_step_seconds"] = round(statistics.median(times[1:]), 6)
        state.metrics["denoise"] = out
        state.write("denoised", Latents(tensor=loop.tensors["latents"], modality="image"), ctx.node.name)
        loop.policy_state.pop("sampler", None)
        loop.policy_state.pop("cfg", None)

    # -- batched steps ------------------------------------------------------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        """Equal for requests whose next step may run as one stacked forward, else None.

        Not batched: a bound interceptor, taps, ``exact`` requests (a stacked batch changes GEMM
        shapes, so the last bits differ from running alone), CFG policies whose plan depends on
        per-request cached state (only ``classic``, ``batched`` and ``interval`` batch)."""
        got = batchable(ctx, state, loop)
        if got is None:
            return None
        pol, step = got
        plan = peek_plan(pol, step, loop)
        if plan is None:
            return None
        names = self.policy_names(pol)
        lat = loop.tensors["latents"]
        text = state.read("prompt_embeds", Embeddings).tensor
        return ("sd3-denoise", tuple(lat.shape), str(lat.dtype), str(lat.device), tuple(text.shape),
                step.step_index, step.num_steps, step.timestep, names["sampler"], names["cfg"], plan,
                float(pol.cfg_state(loop).scale_for(step)))

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        if not loops:
            return []
        pols, steps = begin_steps(ctxs, states, loops)
        plan = plan_together(pols, steps, loops)
        with torch.no_grad():
            inputs = [self.step_inputs(st, lp.tensors["latents"], pol.timestep(lp))
                      for st, lp, pol in zip(states, loops, pols, strict=True)]
            preds: list[dict[str, torch.Tensor]] = [{} for _ in loops]
            for group in forward_groups(pols[0].cfg, plan):
                out = self.forward(ctxs[0], stack_inputs(inputs, group), None)
                for mine, parts in zip(preds, split_rows(out, inputs, group), strict=True):
                    mine.update(parts)
        return [finish_step(None, pol, s, lp, mine) for pol, s, lp, mine in zip(pols, steps, loops, preds, strict=True)]


__all__ = ["Denoise", "StepInputs", "split_rows", "stack_inputs", "start_at_strength"]
