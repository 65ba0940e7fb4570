"""The ``denoise`` node: one solver step per ``step()``, on omniloop-kit's
:class:`~omniloop_kit.denoise.DenoiseLoop` (on :mod:`omniloop_policies.stepping`: the request's
sampler, CFG policy, router and scales; each model forward hands step interceptors the inputs of
that forward and taps each branch's prediction). Wan's own parts are its model inputs (the I2V
condition concatenated, Wan2.2 TI2V's per-token timesteps and first-frame mask), their stacking
and the routed expert's forward.

Batched steps across requests (the kit's ``batch_key`` / ``step_batch``): what must match beyond
the step is the model-input layout (I2V condition, CLIP states, per-token timesteps), the
text-embedding shapes (Wan pads every prompt to 512 tokens, so different prompts stack as they
are), this step's guidance scale and the expert's dtype; results equal each request alone up to
float reassociation of the stacked forward (tests/wan/test_batching.py).

With the defaults (the checkpoint's scheduler class, classic CFG, native step dtype) this is
diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` loop op for op: tests/wan/test_parity.py
compares final latents and frames with ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from attrs import define

from omniloop.artifacts import Embeddings, Tensors
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, RequestState
from omniloop_kit.compile import blocks_for
from omniloop_kit.denoise import DenoiseLoop, note_expert, randn, request_generator, shape_of
from omniloop_kit.stages import params_of
from omniloop_policies.stepping import stack_rows

from .policies import latent_tokens
from .transformer import wan_forward


@define
class StepInputs:
    """One request's model inputs at one step (what diffusers builds before its forwards)."""

    #: latent model input ``[1, C_in, F, H, W]`` in the expert's dtype (image latents concatenated for I2V)
    x: torch.Tensor
    #: ``[1]`` (Wan2.1, Wan2.2 A14B) or ``[1, seq_len]`` (Wan2.2 TI2V, one timestep per token)
    timestep: torch.Tensor
    #: text-encoder states by logical branch (``cond`` → prompt, ``uncond`` → negative prompt)
    text: dict[str, torch.Tensor]
    #: CLIP image states (Wan2.1 I2V) or None
    image_embeds: torch.Tensor | None


class Denoise(DenoiseLoop):
    """One solver step per ``step()``: route to an expert, run the planned branches, combine, step
    (omniloop-kit's skeleton, batched steps across requests included)."""

    tag = "wan-denoise"
    modality = "video"

    def __init__(self, model_config: dict[str, Any], menu: Any) -> None:
        super().__init__(menu)
        self.expand_timesteps = bool(model_config.get("expand_timesteps"))

    # -- init ---------------------------------------------------------------------------------
    def policies(self, ctx: StageContext, state: RequestState) -> Any:
        """The request's DenoisePolicies, resolved once with the request (``WanParams.policies``)."""
        p = params_of(state)
        if p.policies is None:
            raise RuntimeError(f"node {ctx.node.name!r}: the request's params carry no resolved denoise policies")
        return p.policies

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = params_of(state)
        pol = self.policies(ctx, state)
        comps = ctx.components
        tf, vae = comps["transformer"], comps["vae"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        shape = (1, vae.config.z_dim, (p.frames - 1) // temporal + 1, p.height // spatial, p.width // spatial)
        generator = request_generator(state)
        loop = LoopState()
        loop.tensors["latents"] = randn(shape, generator, ctx.device, pol.precision.latents_dtype)
        pol.init(loop, device=ctx.device, generator=generator, seq_len=latent_tokens(shape, tuple(tf.config.patch_size)))
        loop.extra["experts_used"] = []
        return loop

    # -- inputs ---------------------------------------------------------------------------------
    def inputs(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, expert: str | None) -> StepInputs:
        """(latent model input, timestep, text and image embeds) for this step, as diffusers builds them."""
        latents, t, dtype = loop.tensors["latents"], pol.timestep(loop), pol.precision.dtype_for(expert)
        cond = state.get("image_cond")
        values = cond.values if isinstance(cond, Tensors) else {}
        if self.expand_timesteps:
            if "first_frame_mask" in values:  # TI2V image-to-video: the first latent frame is the image
                mask = values["first_frame_mask"]
                x = ((1 - mask) * values["condition"] + mask * latents).to(dtype)
            else:
                mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
                x = latents.to(dtype)
            ts = (mask[0][0][:, ::2, ::2] * t).flatten()
            timestep = ts.unsqueeze(0).expand(latents.shape[0], -1)
        elif "condition" in values:
            x = torch.cat([latents, values["condition"]], dim=1).to(dtype)
            timestep = t.expand(latents.shape[0])
        else:
            x = latents.to(dtype)
            timestep = t.expand(latents.shape[0])
        text = {
            "cond": state.read("prompt_embeds", Embeddings).tensor,
            "uncond": state.read("negative_embeds", Embeddings).tensor,
        }
        return StepInputs(x=x, timestep=timestep, text=text, image_embeds=values.get("image_embeds"))

    def stack(self, inputs: Sequence[StepInputs], group: tuple[str, ...]) -> dict[str, Any]:
        """Request-major, then the group's branches; one request and one branch pass through
        untouched (no copy), which keeps the default path bit-exact."""
        return stack_rows(inputs, group, lambda inp, b: {
            "hidden_states": inp.x, "timestep": inp.timestep, "encoder_hidden_states": inp.text[b],
            "encoder_hidden_states_image": inp.image_embeds,
        })

    def rows(self, inputs: StepInputs) -> int:
        return int(inputs.x.shape[0])

    def forward(
        self, ctx: StageContext, expert: str, batch: dict[str, Any], block_ctx: BlockContext | None
    ) -> torch.Tensor:
        """One transformer forward on a (stacked) batch."""
        model = ctx.components[expert]
        return wan_forward(
            model, batch["hidden_states"], batch["timestep"], batch["encoder_hidden_states"],
            batch["encoder_hidden_states_image"], block_ctx, blocks=blocks_for(model, ctx),
        )

    def note(self, loop: LoopState, expert: str | None) -> None:
        note_expert(loop, expert)

    # -- finalize -----------------------------------------------------------------------------
    def final_latents(self, ctx: StageContext, state: RequestState, loop: LoopState) -> torch.Tensor:
        latents = loop.tensors["latents"]
        cond = state.get("image_cond")
        if self.expand_timesteps and isinstance(cond, Tensors) and "first_frame_mask" in cond.values:
            mask = cond.values["first_frame_mask"]
            latents = (1 - mask) * cond.values["condition"] + mask * latents
        state.metrics["experts"] = list(loop.extra.get("experts_used", []))
        return latents

    # -- batched steps --------------------------------------------------------------------------
    def key(self, ctx: StageContext, state: RequestState, loop: LoopState, pol: Any, step: Any) -> Hashable:
        cond = state.get("image_cond")
        values = cond.values if isinstance(cond, Tensors) else {}
        image = tuple(sorted((k, shape_of(v)) for k, v in values.items()))
        text = tuple(shape_of(state.read(e, Embeddings).tensor) for e in ("prompt_embeds", "negative_embeds"))
        return (image, text, float(pol.cfg_state(loop).scale_for(step)), str(pol.precision.dtype_for(step.expert)))


__all__ = ["Denoise", "StepInputs"]
