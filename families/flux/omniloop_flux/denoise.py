"""The ``denoise`` node: one flow-matching Euler step per ``step()``, on omniloop-policies.

``init`` draws the noise (``[1, C, H/8, W/8]``, diffusers' ``randn_tensor``), packs it into 2x2
patches (``[1, N, 4C]``), resolves the request's policies and lets them allocate the request's own
scheduler (``mu`` from ``N`` for FLUX.1 [dev]; for i2i the schedule is cut by ``strength`` and the
image latents are noised to its first timestep with ``scale_noise``). A step then is one
transformer forward per planned branch — ``cond`` only with embedded guidance, ``cond`` and
``uncond`` (the negative prompt) with true CFG (``classic``) — the CFG combine, the sampler step, taps
(``omniloop_policies.stepping``: ``begin_step``, ``branch_predictions``, ``finish_step``).

Batched steps across requests (``batch_key`` / ``step_batch``): requests whose latents, text
shapes, step index, timestep and dtype agree run their step as one forward over the stacked batch
(each request keeps its own guidance value and scheduler); results equal each request alone up to
float reassociation in the stacked GEMMs (tests/flux/test_batching.py states the tolerance). Not
batched: a bound block/step interceptor, taps, ``exact`` requests, true CFG.

With the defaults this is ``FluxPipeline`` / ``FluxImg2ImgPipeline``'s loop op for op
(tests/flux/test_parity.py compares final latents and the uint8 image with ``torch.equal``).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from attrs import define

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop_policies.stepping import (
    batchable,
    begin_step,
    begin_steps,
    branch_predictions,
    finish_step,
    plan_together,
    stack_rows,
    unstack_rows,
)

from .resolve import FluxParams
from .stages import vae_scale_factor
from .transformer import flux_forward


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` → ``[B, (H/2)(W/2), 4C]`` (2x2 patches, channel-major within a patch)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for latent height ``h`` and width ``w``."""
    b, _, ch = latents.shape
    x = latents.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


def image_ids(h2: int, w2: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Position ids ``[h2 * w2, 3]`` of the packed image tokens: (0, row, column)."""
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3).to(device=device, dtype=dtype)


def _params(state: RequestState) -> FluxParams:
    return state.read("params", Conditioning).values["params"]


@define
class StepInputs:
    """One request's model inputs at one step, per guidance branch where they differ."""

    x: torch.Tensor
    timestep: torch.Tensor
    guidance: torch.Tensor | None
    #: the T5 states through the transformer's ``context_embedder`` (once per request), by branch
    context: dict[str, torch.Tensor]
    #: CLIP's pooled output, by branch (``cond``: the prompt, ``uncond``: the negative prompt)
    pooled: dict[str, torch.Tensor]
    #: the rotary embedding of the text and image position ids (once per request)
    rotary: Any


def stack(inputs: Sequence[StepInputs], branch: str = "cond") -> dict[str, Any]:
    """The batch of one forward of ``branch`` (request-major); one request passes its tensors untouched."""
    batch = stack_rows(inputs, (branch,), lambda inp, b: {
        "hidden_states": inp.x, "timestep": inp.timestep, "guidance": inp.guidance, "context": inp.context[b],
        "pooled_projections": inp.pooled[b],
    })
    batch["image_rotary_emb"] = inputs[0].rotary  # the same positions for every request of a batch
    return batch


class Denoise:
    """One solver step per ``step()``."""

    def __init__(self, menu: Any) -> None:
        self.menu = menu

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = _params(state)
        pol = p.policies if p.policies is not None else self.menu.resolve(state.request)
        comps = ctx.components
        tf, vae = comps["transformer"], comps["vae"]
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype
        vsf = vae_scale_factor(vae)
        lh, lw = 2 * (p.height // (vsf * 2)), 2 * (p.width // (vsf * 2))
        channels = tf.config.in_channels // 4
        generator = state.generator
        if generator is None:  # driven without a runtime: still deterministic per request
            generator = torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))
        from diffusers.utils.torch_utils import randn_tensor

        loop = LoopState()
        seq_len = (lh // 2) * (lw // 2)
        pol.init(loop, device=ctx.device, generator=generator, seq_len=seq_len)
        shape = (1, channels, lh, lw)
        cond = state.get("image_latents")
        if isinstance(cond, Tensors):  # i2i: the image noised to the first kept timestep
            image_latents = cond.values["latents"].to(device=ctx.device, dtype=dtype)
            noise = randn_tensor(shape, generator=generator, device=ctx.device, dtype=dtype)
            sstate = pol.sampler_state(loop)
            latents = sstate.scheduler.scale_noise(image_latents, sstate.timesteps[:1].repeat(1), noise)
        else:
            latents = randn_tensor(shape, generator=generator, device=ctx.device, dtype=dtype)
        loop.tensors["latents"] = pack_latents(latents)
        loop.tensors["img_ids"] = image_ids(lh // 2, lw // 2, ctx.device, dtype)
        loop.extra["latent_hw"] = (lh, lw)
        return loop

    def step_inputs(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepInputs:
        pol = loop.policy_state["policies"]
        latents = loop.tensors["latents"]
        t = pol.timestep(loop)
        step = pol.step_context(loop, request_id=state.request.request_id, node=ctx.node.name)
        guidance = None
        if ctx.components["transformer"].config.guidance_embeds:
            g = pol.model_guidance(step, loop)
            if g is None:  # true CFG: the guidance embedding gets the task's default guidance
                g = _params(state).embedded_guidance
            guidance = torch.full([1], float(g), device=latents.device, dtype=torch.float32).expand(latents.shape[0])
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        if "context" not in loop.extra:  # per-request constants of the forward, computed once
            from .transformer import request_constants

            tf = ctx.components["transformer"]
            context: dict[str, torch.Tensor] = {}
            pooled: dict[str, torch.Tensor] = {}
            for branch, edge in (("cond", "prompt_embeds"), ("uncond", "negative_embeds")):
                emb = state.get(edge)
                if not isinstance(emb, Embeddings):
                    continue
                context[branch], rotary = request_constants(tf, emb.tensor, loop.tensors["img_ids"], emb.extra["text_ids"])
                pooled[branch] = emb.extra["pooled"]
            loop.extra.update(context=context, pooled=pooled, rotary=rotary)
        return StepInputs(
            x=latents, timestep=timestep / 1000, guidance=guidance, context=loop.extra["context"],
            pooled=loop.extra["pooled"], rotary=loop.extra["rotary"],
        )

    def forward(self, ctx: StageContext, batch: dict[str, Any], block_ctx: BlockContext | None) -> torch.Tensor:
        from .compile import blocks_for

        model = ctx.components["transformer"]
        return flux_forward(model, block_ctx=block_ctx, blocks=blocks_for(model, ctx), **batch)

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        pol, step = begin_step(ctx, state, loop)
        with torch.no_grad():
            inp = self.step_inputs(ctx, state, loop)
            preds = branch_predictions(
                ctx, step, loop, [(branch,) for branch in pol.plan(step, loop)],  # one forward per branch
                batch=lambda group: stack([inp], group[0]),
                forward=lambda batch, bctx: self.forward(ctx, batch, bctx),
                split=lambda out, group: {group[0]: out},
                prefix="transformer.blocks",
            )
        return finish_step(ctx, pol, step, loop, preds)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        lh, lw = loop.extra["latent_hw"]
        latents = unpack_latents(loop.tensors["latents"], lh, lw)
        pol = loop.policy_state.get("policies")
        if pol is not None:
            state.metrics["policies"] = pol.metrics(loop)
        times = state.metrics.get("step_seconds")
        if times:
            info: dict[str, Any] = {"first_step_seconds": times[0]}
            if len(times) > 1:
                info["steady_step_seconds"] = round(statistics.median(times[1:]), 6)
            from .compile import compile_info

            ci = compile_info(ctx)
            if ci is not None:
                info["compile"] = ci
            state.metrics["denoise"] = info
        state.write("denoised", Latents(tensor=latents, modality="image"), ctx.node.name)
        loop.policy_state.pop("sampler", None)
        loop.policy_state.pop("cfg", None)
        for key in ("context", "pooled", "rotary"):
            loop.extra.pop(key, None)

    # -- batched steps ----------------------------------------------------------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        got = batchable(ctx, state, loop)
        if got is None or got[0].cfg.name != "embedded":  # true CFG runs alone
            return None
        pol, step = got
        emb = state.read("prompt_embeds", Embeddings)
        lat = loop.tensors["latents"]
        return (
            "flux-denoise", tuple(lat.shape), str(lat.dtype), str(lat.device), tuple(emb.tensor.shape),
            str(emb.tensor.dtype), step.step_index, step.num_steps, step.timestep, pol.sampler.name, pol.cfg.name,
        )

    def step_batch(
        self, ctxs: Sequence[StageContext], states: Sequence[RequestState], loops: Sequence[LoopState]
    ) -> list[StepResult]:
        if not loops:
            return []
        ctx0 = ctxs[0]
        pols, steps = begin_steps(ctxs, states, loops)
        with torch.no_grad():
            inputs = [self.step_inputs(ctx, st, lp) for ctx, st, lp in zip(ctxs, states, loops, strict=True)]
            plan_together(pols, steps, loops)  # ("cond",): embedded guidance (batch_key)
            out = self.forward(ctx0, stack(inputs), None)
        return [finish_step(None, pol, s, lp, pred) for pol, s, lp, pred
                in zip(pols, steps, loops, unstack_rows(out, [i.x.shape[0] for i in inputs], ("cond",)), strict=True)]
