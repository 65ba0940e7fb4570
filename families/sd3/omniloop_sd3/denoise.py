"""The ``denoise`` node: one flow-matching step per ``step()``, on omniloop-policies.

``init`` resolves nothing new: the validate node already chose the request's
:class:`omniloop_policies.DenoisePolicies` (sampler, CFG policy, shift, scales). It draws the
initial latents — pure noise for t2i, the noised image latents for i2i — and lets the policies
allocate their per-request state (a fresh scheduler instance, the CFG state); for i2i the policies
carry the request's ``strength``, so the sampler cuts the schedule where diffusers' img2img
pipeline starts it.

A step::

    step   = pol.step_context(loop, ...)      # index, host timestep
    plan   = pol.plan(step, loop)             # ("cond", "uncond") with CFG, else ("cond",)
    preds  = one transformer forward per forward group (the default ``batched`` policy stacks
             uncond and cond rows in one forward, uncond first, as diffusers does)
    guided = pol.combine(step, loop, preds)   # uncond + s * (cond - uncond)
    latents = pol.advance(step, loop, guided, latents)

(omniloop-kit's :class:`~omniloop_kit.denoise.DenoiseLoop` orders these calls; SD3's own parts are
its initial latents, its inputs, the uncond-first stacking and the forward.)

Batched steps across requests (the ``step`` scheduler): ``batch_key`` / ``step_batch`` stack every
request's rows into one forward; each request then combines and steps its own scheduler.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch

from omniloop.artifacts import Embeddings, Tensors
from omniloop.context import StageContext
from omniloop.loop import LoopState, RequestState
from omniloop_kit.compile import blocks_for
from omniloop_kit.denoise import DenoiseLoop, randn, request_generator, step_time_metrics
from omniloop_kit.stages import params_of, vae_scale_factor
from omniloop_policies.stepping import stack_rows, unstack_rows

from .transformer import sd3_forward

#: row order inside a stacked CFG forward: diffusers' ``torch.cat([negative, positive])``
ROW_ORDER = {"uncond": 0, "cond": 1}


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


class Denoise(DenoiseLoop):
    """One solver step per ``step()``; batched across requests with ``batch_key`` / ``step_batch``."""

    tag = "sd3-denoise"
    model_forward = staticmethod(sd3_forward)  # compiled blocks, options.cuda_graphs: the kit's forward

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = params_of(state)
        pol = p.policies
        tf, vae = ctx.components["transformer"], ctx.components["vae"]
        scale = vae_scale_factor(vae)
        shape = (1, int(tf.config.in_channels), p.height // scale, p.width // scale)
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype  # diffusers: prompt_embeds.dtype
        generator = request_generator(state)
        loop = LoopState()
        patch = int(tf.config.patch_size)
        seq_len = (shape[2] // patch) * (shape[3] // patch)
        if p.strength is None:
            loop.tensors["latents"] = randn(shape, generator, ctx.device, dtype)
        # i2i: the policies carry the strength, so their sampler starts the schedule where
        # diffusers' img2img get_timesteps does
        pol.init(loop, device=ctx.device, generator=generator, seq_len=seq_len)
        if p.strength is not None:  # the image latents noised to the first kept timestep
            s = loop.policy_state["sampler"]
            image_latents = state.read("image_latents", Tensors).values["latents"]
            noise = randn(tuple(image_latents.shape), generator, ctx.device, dtype)
            latents = s.scheduler.scale_noise(image_latents, s.timesteps[:1].repeat(1), noise)
            loop.tensors["latents"] = latents.to(device=ctx.device, dtype=dtype)
        return loop

    def step_inputs(self, state: RequestState, latents: torch.Tensor, t: torch.Tensor) -> StepInputs:
        pos, neg = state.read("prompt_embeds", Embeddings), state.read("negative_embeds", Embeddings)
        return StepInputs(
            latents=latents, timestep=t.expand(latents.shape[0]),
            text={"cond": pos.tensor, "uncond": neg.tensor},
            pooled={"cond": pos.extra["pooled"], "uncond": neg.extra["pooled"]},
        )

    def inputs(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, expert: str | None) -> StepInputs:
        return self.step_inputs(state, loop.tensors["latents"], pol.timestep(loop))

    def stack(self, inputs: Sequence[StepInputs], group: tuple[str, ...]) -> dict[str, Any]:
        return stack_inputs(inputs, group)

    def split(self, out: torch.Tensor, inputs: Sequence[StepInputs], group: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        return split_rows(out, inputs, group)

    def prefix(self, expert: str | None) -> str:
        return "transformer.transformer_blocks"

    def denoise_metrics(self, ctx: StageContext, state: RequestState) -> dict[str, Any]:
        compiled = blocks_for(ctx.components["transformer"], ctx) is not None
        return {"compiled_blocks": compiled, **(step_time_metrics(ctx, state) or {})}

    def key(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, step: Any) -> Hashable:
        text = state.read("prompt_embeds", Embeddings).tensor
        return (tuple(text.shape), float(pol.cfg_state(loop).scale_for(step)))


__all__ = ["Denoise", "StepInputs", "split_rows", "stack_inputs"]
