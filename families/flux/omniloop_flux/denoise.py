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

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from attrs import define

from omniloop.artifacts import Embeddings, Tensors
from omniloop.context import StageContext
from omniloop.loop import LoopState, RequestState
from omniloop_kit.denoise import DenoiseLoop, randn, request_generator
from omniloop_kit.stages import params_of, vae_scale_factor
from omniloop_policies.stepping import stack_rows

from .blocks import modulation_table
from .transformer import flux_forward, request_constants, time_embedding


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
    #: this step's row of the request's modulation table, by branch (``options.modulation:
    #: per-request``; :func:`omniloop_flux.blocks.modulation_table`), else None
    modulation: dict[str, torch.Tensor] | None = None


def stack(inputs: Sequence[StepInputs], branch: str = "cond") -> dict[str, Any]:
    """The batch of one forward of ``branch`` (request-major); one request passes its tensors untouched."""
    batch = stack_rows(inputs, (branch,), lambda inp, b: {
        "hidden_states": inp.x, "timestep": inp.timestep, "guidance": inp.guidance, "context": inp.context[b],
        "pooled_projections": inp.pooled[b],
        "modulation": None if inp.modulation is None else inp.modulation[b],
    })
    batch["image_rotary_emb"] = inputs[0].rotary  # the same positions for every request of a batch
    return batch


class Denoise(DenoiseLoop):
    """One solver step per ``step()`` (omniloop-kit's skeleton); batched across requests under
    embedded guidance (true CFG runs alone)."""

    tag = "flux-denoise"
    name_policies = False
    model_forward = staticmethod(flux_forward)  # compiled blocks, options.cuda_graphs: the kit's forward

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = params_of(state)
        pol = p.policies if p.policies is not None else self.menu.resolve(state.request)
        comps = ctx.components
        tf, vae = comps["transformer"], comps["vae"]
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype
        vsf = vae_scale_factor(vae)
        lh, lw = 2 * (p.height // (vsf * 2)), 2 * (p.width // (vsf * 2))
        channels = tf.config.in_channels // 4
        generator = request_generator(state)
        loop = LoopState()
        seq_len = (lh // 2) * (lw // 2)
        pol.init(loop, device=ctx.device, generator=generator, seq_len=seq_len)
        shape = (1, channels, lh, lw)
        cond = state.get("image_latents")
        if isinstance(cond, Tensors):  # i2i: the image noised to the first kept timestep
            image_latents = cond.values["latents"].to(device=ctx.device, dtype=dtype)
            noise = randn(shape, generator, ctx.device, dtype)
            sstate = pol.sampler_state(loop)
            latents = sstate.scheduler.scale_noise(image_latents, sstate.timesteps[:1].repeat(1), noise)
        else:
            latents = randn(shape, generator, ctx.device, dtype)
        loop.tensors["latents"] = pack_latents(latents)
        loop.tensors["img_ids"] = image_ids(lh // 2, lw // 2, ctx.device, dtype)
        loop.extra["latent_hw"] = (lh, lw)
        return loop

    def step_inputs(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepInputs:
        pol = loop.policy_state["policies"]
        latents = loop.tensors["latents"]
        t = pol.timestep(loop)
        step = pol.step_context(loop, request_id=state.request.request_id, node=ctx.node.name)
        guidance, g = None, None
        if ctx.components["transformer"].config.guidance_embeds:
            g = pol.model_guidance(step, loop)
            if g is None:  # true CFG: the guidance embedding gets the task's default guidance
                g = params_of(state).embedded_guidance
            guidance = torch.full([1], float(g), device=latents.device, dtype=torch.float32).expand(latents.shape[0])
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        if "context" not in loop.extra:  # per-request constants of the forward, computed once
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
        timestep = timestep / 1000
        modulation = None
        if (ctx.options or {}).get("modulation") == "per-request":
            modulation = self.modulation_rows(ctx, loop, pol, timestep.dtype, g, guidance, latents.shape[0])
        return StepInputs(
            x=latents, timestep=timestep, guidance=guidance, context=loop.extra["context"],
            pooled=loop.extra["pooled"], rotary=loop.extra["rotary"], modulation=modulation,
        )

    def modulation_rows(self, ctx: StageContext, loop: LoopState, pol: Any, dtype: torch.dtype, g: float | None,
                        guidance: torch.Tensor | None, rows: int) -> dict[str, torch.Tensor]:
        """This step's rows of the request's modulation tables (one per branch), built on the first step
        over every timestep of the request's schedule — the time embedding of each step exactly as
        :func:`flux_forward` would compute it at that step — and again if the guidance value changes."""
        sstate = pol.sampler_state(loop)
        held = loop.extra.get("modulation")
        if held is None or held[0] != g:
            tf = ctx.components["transformer"]
            tables = {}
            for branch, pooled in loop.extra["pooled"].items():
                temb = torch.cat([time_embedding(tf, sstate.timesteps[i].expand(1).to(dtype) / 1000,
                                                 None if guidance is None else guidance[:1], pooled, dtype)
                                  for i in range(sstate.num_steps)])
                tables[branch] = modulation_table(tf, temb)
            held = (g, tables)
            loop.extra["modulation"] = held
        i = sstate.index
        return {branch: table[i:i + 1].expand(rows, -1) for branch, table in held[1].items()}

    def inputs(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, expert: str | None) -> StepInputs:
        return self.step_inputs(ctx, state, loop)

    def stack(self, inputs: Sequence[StepInputs], group: tuple[str, ...]) -> dict[str, Any]:
        return stack(inputs, group[0])

    def rows(self, inputs: StepInputs) -> int:
        return int(inputs.x.shape[0])

    def prefix(self, expert: str | None) -> str:
        return "transformer.blocks"

    def final_latents(self, ctx: StageContext, state: RequestState, loop: LoopState) -> torch.Tensor:
        return unpack_latents(loop.tensors["latents"], *loop.extra["latent_hw"])

    def release(self, loop: LoopState) -> None:
        super().release(loop)
        for key in ("context", "pooled", "rotary", "modulation"):
            loop.extra.pop(key, None)

    def plan_of(self, pol: Any, step: Any, loop: LoopState) -> tuple[str, ...] | None:
        return ("cond",) if pol.cfg.name == "embedded" else None  # true CFG runs alone

    def key(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, step: Any) -> Hashable:
        emb = state.read("prompt_embeds", Embeddings).tensor
        return (tuple(emb.shape), str(emb.dtype))
