"""The ``denoise`` node: one solver step per ``step()``, on omniloop-policies.

Per request, ``init`` resolves the request's :class:`omniloop_policies.DenoisePolicies` (sampler,
CFG policy, router, scales) and lets them allocate their state in ``LoopState.policy_state`` —
a fresh diffusers scheduler instance, the CFG state — and declare the guidance branches
(``LoopState.branches``). A step then is::

    step  = pol.step_context(loop, ...)          # index, host timestep, expert (router)
    plan  = pol.plan(step, loop)                 # the branches this step computes
    preds = one model forward per forward group  # ("cond",), ("uncond",) or ("cond", "uncond") stacked
    guided = pol.combine(step, loop, preds)      # the CFG policy's formula
    latents = pol.advance(step, loop, guided, x) # the request's own scheduler step

The family calls the pieces rather than ``pol.predict`` so that each model forward hands step
interceptors the inputs *of that forward* (its text embeddings, the stacked batch of a batched
group) and taps each branch's prediction right after its forward — through
:mod:`omniloop_policies.stepping` (``begin_step``, ``branch_predictions``, ``finish_step``), which
SD3 and Flux use too; Wan's own parts are its inputs, its stacking and the expert's forward.

``loop.step`` is advanced by the runtime after ``step()`` returns (``Execution._after_step``);
the sampler keeps its own index and the two are checked against each other every step.

With the defaults (the checkpoint's scheduler class, classic CFG, native step dtype) this is
diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` loop op for op: tests/wan/test_parity.py
compares final latents and frames with ``torch.equal``.
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
from omniloop_policies import forward_groups
from omniloop_policies.stepping import (
    begin_step,
    branch_predictions,
    finish_step,
    policy_names,
    stack_rows,
    unstack_rows,
)

from .policies import latent_tokens
from .resolve import WanParams
from .transformer import wan_forward


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' ``randn_tensor``: drawn on the generator's device, then moved."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def _params(state: RequestState) -> WanParams:
    return state.read("params", Conditioning).values["params"]


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


def stack_inputs(inputs: Sequence[StepInputs], group: tuple[str, ...]) -> dict[str, Any]:
    """The stacked batch of one model forward: request-major, then the group's branches.

    Row blocks are ``[(r0, b0), (r0, b1), (r1, b0), ...]``; with one request and one branch the
    tensors are passed through untouched (no copy), which keeps the default path bit-exact."""
    return stack_rows(inputs, group, lambda inp, b: {
        "hidden_states": inp.x, "timestep": inp.timestep, "encoder_hidden_states": inp.text[b],
        "encoder_hidden_states_image": inp.image_embeds,
    })


def split_rows(out: torch.Tensor, inputs: Sequence[StepInputs], group: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """Undo :func:`stack_inputs` on a prediction: per request, ``{branch: prediction}``."""
    return unstack_rows(out, [inp.x.shape[0] for inp in inputs], group)


class Denoise:
    """One solver step per ``step()``: route to an expert, run the planned branches, combine, step.

    Batched steps across requests: ``batch_key`` / ``step_batch`` (:mod:`omniloop_wan.batching`).
    """

    def __init__(self, model_config: dict[str, Any], menu: Any) -> None:
        self.menu = menu
        self.expand_timesteps = bool(model_config.get("expand_timesteps"))

    def policy_names(self, pol: Any) -> dict[str, str]:
        """The menu names of a request's sampler and CFG policy (:func:`omniloop_policies.stepping.policy_names`)."""
        return policy_names(self.menu, pol)

    # -- init ---------------------------------------------------------------------------------
    def policies(self, ctx: StageContext, state: RequestState) -> Any:
        """The request's DenoisePolicies, resolved once with the request (``WanParams.policies``)."""
        p = _params(state)
        if p.policies is None:
            raise RuntimeError(f"node {ctx.node.name!r}: the request's params carry no resolved denoise policies")
        return p.policies

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = _params(state)
        pol = self.policies(ctx, state)
        comps = ctx.components
        tf, vae = comps["transformer"], comps["vae"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        shape = (1, vae.config.z_dim, (p.frames - 1) // temporal + 1, p.height // spatial, p.width // spatial)
        generator = state.generator
        if generator is None:  # driven without a runtime: still deterministic per request
            generator = torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))
        loop = LoopState()
        loop.tensors["latents"] = _randn(shape, generator, ctx.device, pol.precision.latents_dtype)
        pol.init(loop, device=ctx.device, generator=generator, seq_len=latent_tokens(shape, tuple(tf.config.patch_size)))
        loop.extra["experts_used"] = []
        return loop

    # -- inputs -------------------------------------------------------------------------------
    def step_inputs(self, state: RequestState, latents: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> StepInputs:
        """(latent model input, timestep, text and image embeds) for this step, as diffusers builds them."""
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

    def forward(
        self, ctx: StageContext, expert: str, batch: dict[str, Any], block_ctx: BlockContext | None
    ) -> torch.Tensor:
        """One transformer forward on a (stacked) batch."""
        from .compile import blocks_for

        model = ctx.components[expert]
        return wan_forward(
            model, batch["hidden_states"], batch["timestep"], batch["encoder_hidden_states"],
            batch["encoder_hidden_states_image"], block_ctx, blocks=blocks_for(model, ctx),
        )

    # -- one step -----------------------------------------------------------------------------
    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        pol, step = begin_step(ctx, state, loop)
        expert = step.expert
        _note_expert(loop, expert)
        with torch.no_grad():
            inp = self.step_inputs(state, loop.tensors["latents"], pol.timestep(loop), pol.precision.dtype_for(expert))
            preds = branch_predictions(
                ctx, step, loop, forward_groups(pol.cfg, pol.plan(step, loop)),
                batch=lambda group: stack_inputs([inp], group),
                forward=lambda batch, bctx: self.forward(ctx, expert, batch, bctx),
                split=lambda out, group: split_rows(out, [inp], group)[0],
                prefix=f"{expert}.blocks",
            )
        return finish_step(ctx, pol, step, loop, preds)

    # -- finalize -----------------------------------------------------------------------------
    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        latents = loop.tensors["latents"]
        cond = state.get("image_cond")
        if self.expand_timesteps and isinstance(cond, Tensors) and "first_frame_mask" in cond.values:
            mask = cond.values["first_frame_mask"]
            latents = (1 - mask) * cond.values["condition"] + mask * latents
        state.metrics["experts"] = list(loop.extra.get("experts_used", []))
        pol = loop.policy_state.get("policies")
        if pol is not None:
            state.metrics["policies"] = {**pol.metrics(loop), **self.policy_names(pol)}
        _step_time_metrics(ctx, state)
        state.write("denoised", Latents(tensor=latents, modality="video"), ctx.node.name)
        # the request's scheduler instance (with its multistep history) and CFG caches go now
        loop.policy_state.pop("sampler", None)
        loop.policy_state.pop("cfg", None)

    # -- batched steps (several requests; see omniloop_wan.batching) ----------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        from .batching import batch_key

        return batch_key(self, ctx, state, loop)

    def step_batch(
        self, ctxs: Sequence[StageContext], states: Sequence[RequestState], loops: Sequence[LoopState]
    ) -> list[StepResult]:
        from .batching import step_batch

        return step_batch(self, ctxs, states, loops)



def _note_expert(loop: LoopState, expert: str | None) -> None:
    used = loop.extra.setdefault("experts_used", [])
    if expert is not None and (not used or used[-1] != expert):
        used.append(expert)


def _step_time_metrics(ctx: StageContext, state: RequestState) -> None:
    """First-step seconds apart from the rest: the first holds loop set-up and, with compiled
    blocks, compilation (a new shape recompiles); the rest is steady state."""
    times = state.metrics.get("step_seconds")
    if not times:
        return
    out: dict[str, Any] = {"first_step_seconds": times[0]}
    if len(times) > 1:
        out["steady_step_seconds"] = round(statistics.median(times[1:]), 6)
    from .compile import compile_info

    info = compile_info(ctx)
    if info is not None:
        out["compile"] = info
    state.metrics["denoise"] = out


__all__ = ["Denoise", "StepInputs", "split_rows", "stack_inputs"]
