"""The ``denoise`` node: one ``CosineDPMSolverMultistepScheduler`` step per ``step()``.

``init`` gives the request its own scheduler instance (built from the checkpoint's config, so its
solver history and Brownian-tree noise sampler belong to this request alone), draws the initial
latents ``[1, C, T]`` with diffusers' ``randn_tensor`` from the request's generator and scales them
by ``init_noise_sigma``. A step is diffusers' loop body: the latents doubled for CFG, scaled by
``scale_model_input``, one DiT forward over the rows ``[uncond, cond]`` (through the step
interceptors, the blocks through ``run_blocks``), ``uncond + g * (cond - uncond)``, and the
scheduler step with the request's generator — whose initial seed seeds the request's Brownian tree
on the first step, the noise diffusers draws for a waveform with its own generator (one tree per
request, so a request batched with others draws what it draws alone).

Batched steps across requests (the ``step`` scheduler): requests at the same step of equally long
schedules, with the same latent shape, conditioning shape and CFG on/off, run one DiT forward over
all their rows (request-major, uncond first); each then combines with its own guidance scale and
steps its own scheduler. The rows are laid out branch-major — every request's uncond row, then
every cond row — which is how diffusers lays out ``num_waveforms_per_prompt`` waveforms, so the
samples of one ``diffusion.num_outputs`` group batched together compute exactly diffusers'
batch. Every Stable Audio request denoises the checkpoint's whole latent window
(``audio.seconds`` only conditions and cuts the decoded clip), so requests of any length batch.
Not batched: a bound interceptor, taps, ``exact`` requests.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Latents
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext, call_model
from omniloop.loop import LoopState, RequestState, StepContext, StepResult

from .compile import blocks_for
from .graphs import graphs_enabled, replay
from .noise import prefetch_next
from .resolve import AudioResolved
from .transformer import dit_forward, rotary_embedding

#: the branch name of the one forward computing both CFG rows (``StepContext.branch``)
CFG_FORWARD = "uncond+cond"


def _params(state: RequestState) -> AudioResolved:
    return state.read("params", Conditioning).values["params"]


def _generator(state: RequestState) -> torch.Generator:
    if state.generator is not None:
        return state.generator
    return torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))


class Denoise:
    """One solver step per ``step()``; batched across requests with ``batch_key`` / ``step_batch``."""

    #: the scheduler's noise may be prefetched (deploy ``options.noise_prefetch``:
    #: :mod:`omniloop_stable_audio.noise`)
    PREFETCH_NOISE = True
    #: the DiT forward's inputs
    INPUTS: tuple[str, ...] = ("hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states")
    #: the forward inputs stacked row by row in a batched step
    ROWS: tuple[str, ...] = ("hidden_states", "encoder_hidden_states", "global_hidden_states")

    # -- init ---------------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        from diffusers.utils.torch_utils import randn_tensor

        p = _params(state)
        template = ctx.components["scheduler"]
        scheduler = type(template).from_config(template.config)
        scheduler.set_timesteps(p.steps, device=ctx.device)
        cond = state.read("conditioning", Embeddings).tensor
        tf = ctx.components["transformer"]
        shape = (1, int(tf.config.in_channels), int(tf.config.sample_size))
        latents = randn_tensor(shape, generator=_generator(state), device=ctx.device, dtype=cond.dtype)
        loop = LoopState(total=p.steps, branches=(CFG_FORWARD,) if p.cfg else ("cond",))
        loop.tensors["latents"] = latents * scheduler.init_noise_sigma
        loop.extra["scheduler"] = scheduler
        loop.extra["t_values"] = scheduler.timesteps.tolist()  # host copies: no device sync per step
        loop.extra["prefetch"] = self.PREFETCH_NOISE and bool((ctx.options or {}).get("noise_prefetch"))
        return loop

    # -- one step -----------------------------------------------------------------------------
    def step_context(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepContext:
        return StepContext(request_id=state.request.request_id, node=ctx.node.name, step_index=loop.step,
                           num_steps=loop.total, timestep=loop.extra["t_values"][loop.step], branch=loop.branches[0])

    def inputs(self, state: RequestState, loop: LoopState) -> dict[str, torch.Tensor]:
        """This request's rows of the DiT forward at the current step (diffusers' loop body)."""
        p = _params(state)
        scheduler = loop.extra["scheduler"]
        t = scheduler.timesteps[loop.step]
        lat = loop.tensors["latents"]
        x = torch.cat([lat] * 2) if p.cfg else lat
        x = scheduler.scale_model_input(x, t)
        cond = state.read("conditioning", Embeddings)
        return {"hidden_states": x, "timestep": t.unsqueeze(0), "encoder_hidden_states": cond.tensor,
                "global_hidden_states": cond.extra["global"]}

    def forward(self, ctx: StageContext, batch: dict[str, torch.Tensor], block_ctx: BlockContext | None) -> torch.Tensor:
        tf = ctx.components["transformer"]
        x = batch["hidden_states"]
        rotary = rotary_embedding(tf, x.shape[2] + batch["global_hidden_states"].shape[1], x.device)
        blocks = blocks_for(tf, ctx)

        def run(hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                global_hidden_states: torch.Tensor, bctx: BlockContext | None = None) -> torch.Tensor:
            return dit_forward(tf, hidden_states, timestep, encoder_hidden_states, global_hidden_states, rotary,
                               bctx, blocks=blocks)

        if graphs_enabled(ctx, block_ctx):  # deploy options.cuda_graphs: one graph replay per forward
            return replay(tf, blocks is not None, run, {k: batch[k] for k in self.INPUTS})
        return run(**{k: batch[k] for k in self.INPUTS}, bctx=block_ctx)

    def advance(self, state: RequestState, loop: LoopState, out: torch.Tensor) -> None:
        """CFG combine and the scheduler step on this request's rows of a prediction."""
        p = _params(state)
        scheduler = loop.extra["scheduler"]
        if p.cfg:
            uncond, cond = out.chunk(2)
            out = uncond + p.guidance_scale * (cond - uncond)
        t = scheduler.timesteps[loop.step]
        loop.tensors["latents"] = scheduler.step(out, t, loop.tensors["latents"], generator=_generator(state)).prev_sample
        if loop.extra.get("prefetch") and loop.step + 1 < loop.total:
            prefetch_next(scheduler)  # the next step's Brownian-tree noise, while the DiT runs

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        sc = self.step_context(ctx, state, loop)
        with torch.no_grad():
            inputs = self.inputs(state, loop)
            bctx = ctx.block_context(sc, loop, prefix="transformer.transformer_blocks")

            def compute() -> torch.Tensor:
                return self.forward(ctx, inputs, bctx)

            out = call_model(ctx.step_interceptors, sc, loop, inputs, compute)
            if ctx.taps_enabled:
                ctx.tap("noise_pred", out, sc)
            self.advance(state, loop, out)
        if ctx.taps_enabled:
            ctx.tap("latents", loop.tensors["latents"], sc)
        return StepResult(done=loop.step + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        out: dict[str, Any] = {"compiled_blocks": blocks_for(ctx.components["transformer"], ctx) is not None}
        times = state.metrics.get("step_seconds")
        if times:  # the first step holds the loop's set-up and, with compiled blocks, compilation
            out["first_step_seconds"] = times[0]
            if len(times) > 1:
                out["steady_step_seconds"] = round(statistics.median(times[1:]), 6)
        state.metrics["denoise"] = out
        state.write("denoised", Latents(tensor=loop.tensors["latents"], modality="audio"), ctx.node.name)
        scheduler = loop.extra.pop("scheduler", None)
        settle = getattr(getattr(scheduler, "noise_sampler", None), "settle", None)
        if settle is not None:
            settle()

    # -- batched steps ------------------------------------------------------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        """Equal for requests whose next step may run as one stacked forward, else None."""
        if ctx.block_interceptor is not None or ctx.step_interceptors or ctx.block_taps is not None or ctx.taps_enabled:
            return None
        if state.request.exact or loop.step >= loop.total:
            return None
        p = _params(state)
        lat = loop.tensors["latents"]
        text = state.read("conditioning", Embeddings).tensor
        t = loop.extra["t_values"][loop.step]
        return ("stable-audio-denoise", tuple(lat.shape), str(lat.dtype), str(lat.device), tuple(text.shape),
                p.cfg, loop.step, loop.total, t)

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        if not loops:
            return []
        with torch.no_grad():
            rows = [self.inputs(st, lp) for st, lp in zip(states, loops, strict=True)]
            n = rows[0]["hidden_states"].shape[0]  # rows per request: 2 with CFG (uncond, cond), else 1
            # branch-major, as diffusers lays out several waveforms: every uncond row, then every cond row
            batch = {k: torch.cat([r[k][i:i + 1] for i in range(n) for r in rows])
                     for k in self.ROWS}
            batch["timestep"] = rows[0]["timestep"]  # one timestep: part of the batch key
            out = self.forward(ctxs[0], batch, None).chunk(n)
            for j, (st, lp) in enumerate(zip(states, loops, strict=True)):
                self.advance(st, lp, torch.cat([part[j:j + 1] for part in out]) if n > 1 else out[0][j:j + 1])
        return [StepResult(done=lp.step + 1 >= lp.total) for lp in loops]


__all__ = ["CFG_FORWARD", "Denoise"]
