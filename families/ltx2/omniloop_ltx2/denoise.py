"""The ``denoise`` node: one step of both latent streams per ``step()`` — a documented custom step
body (the kit's :class:`~omniloop_kit.denoise.DenoiseLoop` guides one stream; LTX-2 guides two).

``init`` draws the video latents ``[1, C, F, H, W]`` and then the audio latents ``[1, C, L, M]``
from the request's generator (diffusers' order, ``float32``), packs both into token sequences, and
gives the request two schedulers of its own (copies of the checkpoint's ``FlowMatchEuler``
template, one per stream, diffusers' ``sigmas = linspace(1, 1/steps, steps)`` shifted by ``mu``
from the video's token count) and the rope coordinates of both streams. i2v (diffusers'
``LTX2ImageToVideoPipeline``): the first latent frame is the image's (``image_latents``), the rest
noise; its tokens get video timestep 0 (``t * (1 - mask)``, the audio keeps ``t``) and the video's
Euler step moves only the other frames.

A step is diffusers' loop body. Each guidance pass is ONE transformer call that returns both
streams' predictions:

* ``cfg`` — rows ``[uncond, cond]`` (the negative prompt's text first) when video or audio CFG is
  on (``guidance > 1`` for either), else ``cond`` alone;
* ``stg`` — spatio-temporal guidance: the cond rows with the self-attention of ``stg_blocks``
  perturbed (it perturbs only where the transformer config has ``perturbed_attn``), on when
  ``stg > 0`` for either stream;
* ``modality`` — modality isolation: the cond rows without the audio↔video cross-attention, on
  when ``modality > 1`` for either stream.

Per stream, every prediction becomes x0 (``x - v * sigma``), the guided x0 is
``cond + (g - 1)(cond - uncond) + stg (cond - stg_pass) + (m - 1)(cond - modality_pass)`` with the
stream's own scales, rescaled toward the cond's standard deviation (``rescale``; diffusers'
``rescale_noise_cfg``), back to a velocity, and each stream's Euler step. Three calls per default
step (CFG pair, STG, modality), as in diffusers.

Batched steps across requests (the ``step`` scheduler): requests at the same step of equal
schedules, with equal latent shapes (both streams), text length, passes, STG blocks and fps run
each pass as one forward over all their rows (request-major); each request then combines with its
own scales and steps its own schedulers. Not batched: taps, ``exact`` requests.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from omniloop.artifacts import Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop_kit.compile import blocks_for
from omniloop_kit.denoise import request_generator, step_time_metrics
from omniloop_kit.stages import params_of

from .resolve import LTX2Resolved


@contextlib.contextmanager
def running_blocks(tf: Any, blocks: Sequence[Any] | None, eager: Sequence[int] = ()) -> Iterator[None]:
    """diffusers' transformer forward over ``blocks`` (the deploy's compiled blocks; None: its own),
    the blocks at indices ``eager`` left eager (an STG block of a perturbed-attention model
    branches on a tensor, which a ``fullgraph`` compile cannot trace)."""
    if blocks is None:
        yield
        return
    own = tf.transformer_blocks
    tf.transformer_blocks = torch.nn.ModuleList([own[i] if i in eager else b for i, b in enumerate(blocks)])
    try:
        yield
    finally:
        tf.transformer_blocks = own


def _pipeline_module() -> Any:
    from diffusers.pipelines.ltx2 import pipeline_ltx2

    return pipeline_ltx2


class Denoise:
    """Both streams, one step per ``step()``; batched across requests with ``batch_key`` / ``step_batch``."""

    # -- init ---------------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        from diffusers.utils.torch_utils import randn_tensor

        if ctx.step_interceptors:
            raise RuntimeError("the ltx2 denoise loop runs no step interceptors (its step is two streams)")
        mod = _pipeline_module()
        pipe = mod.LTX2Pipeline
        p: LTX2Resolved = params_of(state)
        tf, avae = ctx.components["transformer"], ctx.components["audio_vae"]
        gen = request_generator(state)
        dev = ctx.device
        shape = (1, int(tf.config.in_channels), p.latent_frames, p.latent_height, p.latent_width)
        ps, pt = tf.config.patch_size, tf.config.patch_size_t
        mask = None
        if state.get("image_latents") is not None:  # i2v: the first latent frame is the image's, kept clean
            init = state.read("image_latents", Tensors).values["latents"].repeat(1, 1, p.latent_frames, 1, 1)
            cond = torch.zeros((1, 1, *shape[2:]), device=dev, dtype=torch.float32)
            cond[:, :, 0] = 1.0
            noise = randn_tensor(shape, generator=gen, device=dev, dtype=torch.float32)
            video = pipe._pack_latents(init * cond + noise * (1 - cond), ps, pt)
            mask = pipe._pack_latents(cond, ps, pt).squeeze(-1)
        else:
            video = pipe._pack_latents(randn_tensor(shape, generator=gen, device=dev, dtype=torch.float32), ps, pt)
        mel = int(avae.config.mel_bins) // int(avae.mel_compression_ratio)
        ashape = (1, int(avae.config.latent_channels), p.audio_frames, mel)
        audio = pipe._pack_audio_latents(randn_tensor(ashape, generator=gen, device=dev, dtype=torch.float32))
        template = ctx.components["scheduler"]
        sigmas = np.linspace(1.0, 1 / p.steps, p.steps)
        c = template.config
        mu = mod.calculate_shift(video.shape[1], c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                                 c.get("base_shift", 0.95), c.get("max_shift", 2.05))
        audio_sched, video_sched = copy.deepcopy(template), copy.deepcopy(template)
        mod.retrieve_timesteps(audio_sched, p.steps, dev, None, sigmas=sigmas, mu=mu)
        timesteps, _ = mod.retrieve_timesteps(video_sched, p.steps, dev, None, sigmas=sigmas, mu=mu)
        video_sched.set_begin_index(0)
        audio_sched.set_begin_index(0)
        fps = mod.get_conditioning_frame_rate(p.fps, 1.0)
        loop = LoopState(total=p.steps, branches=p.passes)
        loop.tensors["latents"], loop.tensors["audio_latents"] = video, audio
        if mask is not None:
            loop.tensors["mask"] = mask
        loop.tensors["video_coords"] = tf.rope.prepare_video_coords(1, p.latent_frames, p.latent_height,
                                                                    p.latent_width, dev, fps=fps)
        loop.tensors["audio_coords"] = tf.audio_rope.prepare_audio_coords(1, p.audio_frames, dev)
        loop.extra.update(video_scheduler=video_sched, audio_scheduler=audio_sched, timesteps=timesteps,
                          t_values=timesteps.tolist(), fps=fps, mu=float(mu), patch=(ps, pt))
        return loop

    # -- one step -----------------------------------------------------------------------------
    def forward(self, ctx: StageContext, p: LTX2Resolved, n: int, rows: dict[str, torch.Tensor], t: torch.Tensor,
                cfg_rows: bool, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer call over ``rows`` (``n`` requests; two rows each with ``cfg_rows``)."""
        reps = 2 if cfg_rows else 1
        b = rows["latents"].shape[0]
        timestep = t.expand(b)
        video_timestep = timestep
        if "frame_mask" in rows:  # i2v: the conditioned tokens at timestep 0 (diffusers' t * (1 - mask))
            mask = rows["frame_mask"].repeat(b // rows["frame_mask"].shape[0], 1)
            video_timestep = timestep.unsqueeze(-1) * (1 - mask)
        vc, ac = rows["video_coords"], rows["audio_coords"]
        if reps > 1 or n > 1:
            vc = vc.repeat((b // vc.shape[0],) + (1,) * (vc.ndim - 1))
            ac = ac.repeat((b // ac.shape[0],) + (1,) * (ac.ndim - 1))
        tf = ctx.components["transformer"]
        stg = kw.get("spatio_temporal_guidance_blocks") or ()
        with running_blocks(tf, blocks_for(tf, ctx), stg if tf.config.perturbed_attn else ()):
            out = tf(
                hidden_states=rows["latents"], audio_hidden_states=rows["audio_latents"],
                encoder_hidden_states=rows["text"], audio_encoder_hidden_states=rows["audio_text"],
                timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=rows["mask"], audio_encoder_attention_mask=rows["mask"],
                num_frames=p.latent_frames, height=p.latent_height, width=p.latent_width, fps=rows["fps"],
                audio_num_frames=p.audio_frames, video_coords=vc, audio_coords=ac,
                use_cross_timestep=p.use_cross_timestep, attention_kwargs=None, return_dict=False, **kw)
        return out[0].float(), out[1].float()

    def passes(self, ctx: StageContext, states: Sequence[RequestState], loops: Sequence[LoopState]
               ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Every guidance pass of this step for ``loops`` (one call each), split per request:
        ``{pass: (video x-rows, audio x-rows)}`` raw (velocity) predictions, cfg rows ``[uncond, cond]``."""
        ps: list[LTX2Resolved] = [params_of(s) for s in states]
        p, n = ps[0], len(loops)
        conds = [s.read("conditioning", Embeddings) for s in states]
        dtype = conds[0].tensor.dtype
        lat = [lp.tensors["latents"] for lp in loops]
        alat = [lp.tensors["audio_latents"] for lp in loops]
        t = loops[0].extra["timesteps"][loops[0].step]
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in loops]
        base = {"video_coords": loops[0].tensors["video_coords"], "audio_coords": loops[0].tensors["audio_coords"],
                "fps": loops[0].extra["fps"]}
        if "mask" in loops[0].tensors:
            base["frame_mask"] = loops[0].tensors["mask"]

        def run(name: str, rows: dict[str, torch.Tensor], reps: int, **kw: Any) -> None:
            v, a = self.forward(ctx, p, n, {**base, **rows}, t, reps == 2, **kw)
            for i, (vi, ai) in enumerate(zip(v.chunk(n), a.chunk(n), strict=True)):
                out[i][name] = (vi, ai)

        if p.cfg:
            run("cfg", {"latents": torch.cat([torch.cat([x] * 2) for x in lat]).to(dtype),
                        "audio_latents": torch.cat([torch.cat([x] * 2) for x in alat]).to(dtype),
                        "text": torch.cat([c.tensor for c in conds]), "audio_text": torch.cat([c.extra["audio"] for c in conds]),
                        "mask": torch.cat([c.extra["mask"] for c in conds])}, 2)
        else:
            run("cond", {"latents": torch.cat(lat).to(dtype), "audio_latents": torch.cat(alat).to(dtype),
                         "text": torch.cat([c.tensor for c in conds]), "audio_text": torch.cat([c.extra["audio"] for c in conds]),
                         "mask": torch.cat([c.extra["mask"] for c in conds])}, 1)
        if p.stg_on or p.modality_on:
            def pick(x: torch.Tensor) -> torch.Tensor:  # the cond row (the second of a CFG pair)
                return x[1:2] if p.cfg else x

            rows = {"latents": torch.cat(lat).to(dtype), "audio_latents": torch.cat(alat).to(dtype),
                    "text": torch.cat([pick(c.tensor) for c in conds]),
                    "audio_text": torch.cat([pick(c.extra["audio"]) for c in conds]),
                    "mask": torch.cat([pick(c.extra["mask"]) for c in conds])}
            if p.stg_on:
                run("stg", rows, 1, isolate_modalities=False, spatio_temporal_guidance_blocks=list(p.stg_blocks))
            if p.modality_on:
                run("modality", rows, 1, isolate_modalities=True)
        return out

    @staticmethod
    def advance(state: RequestState, loop: LoopState, preds: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """diffusers' guidance combine and both Euler steps on this request's predictions."""
        rescale_noise_cfg = _pipeline_module().rescale_noise_cfg
        p: LTX2Resolved = params_of(state)
        i = loop.step
        vs, as_ = loop.extra["video_scheduler"], loop.extra["audio_scheduler"]
        lat, alat = loop.tensors["latents"], loop.tensors["audio_latents"]

        def x0(sample: torch.Tensor, out: torch.Tensor, sched: Any) -> torch.Tensor:
            return sample - out * sched.sigmas[i]

        video_cfg_delta: Any = 0
        audio_cfg_delta: Any = 0
        if p.cfg:
            v_u, v = preds["cfg"][0].chunk(2)
            a_u, a = preds["cfg"][1].chunk(2)
            v, v_u = x0(lat, v, vs), x0(lat, v_u, vs)
            video_cfg_delta = (p.guidance - 1) * (v - v_u)
            a, a_u = x0(alat, a, as_), x0(alat, a_u, as_)
            audio_cfg_delta = (p.audio_guidance - 1) * (a - a_u)
        else:
            v, a = x0(lat, preds["cond"][0], vs), x0(alat, preds["cond"][1], as_)
        video_stg_delta: Any = 0
        audio_stg_delta: Any = 0
        if p.stg_on:
            v_s, a_s = x0(lat, preds["stg"][0], vs), x0(alat, preds["stg"][1], as_)
            video_stg_delta = p.stg * (v - v_s)
            audio_stg_delta = p.audio_stg * (a - a_s)
        video_mod_delta: Any = 0
        audio_mod_delta: Any = 0
        if p.modality_on:
            v_m, a_m = x0(lat, preds["modality"][0], vs), x0(alat, preds["modality"][1], as_)
            video_mod_delta = (p.modality - 1) * (v - v_m)
            audio_mod_delta = (p.audio_modality - 1) * (a - a_m)
        v_g = v + video_cfg_delta + video_stg_delta + video_mod_delta
        a_g = a + audio_cfg_delta + audio_stg_delta + audio_mod_delta
        v = rescale_noise_cfg(v_g, v, guidance_rescale=p.rescale) if p.rescale > 0 else v_g
        a = rescale_noise_cfg(a_g, a, guidance_rescale=p.audio_rescale) if p.audio_rescale > 0 else a_g
        t = loop.extra["timesteps"][i]
        if "mask" in loop.tensors:  # i2v: diffusers steps every latent frame but the first (the image's)
            pipe, tf = _pipeline_module().LTX2Pipeline, loop.extra["patch"]
            v = pipe._unpack_latents(v, p.latent_frames, p.latent_height, p.latent_width, *tf)
            lat = pipe._unpack_latents(lat, p.latent_frames, p.latent_height, p.latent_width, *tf)
            v = (lat - v) / vs.sigmas[i]
            a = (alat - a) / as_.sigmas[i]
            stepped = vs.step(v[:, :, 1:], t, lat[:, :, 1:], return_dict=False)[0]
            loop.tensors["latents"] = pipe._pack_latents(torch.cat([lat[:, :, :1], stepped], dim=2), *tf)
            loop.tensors["audio_latents"] = as_.step(a, t, alat, return_dict=False)[0]
            return
        v = (lat - v) / vs.sigmas[i]
        a = (alat - a) / as_.sigmas[i]
        loop.tensors["latents"] = vs.step(v, t, lat, return_dict=False)[0]
        loop.tensors["audio_latents"] = as_.step(a, t, alat, return_dict=False)[0]

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        with torch.no_grad():
            preds = self.passes(ctx, [state], [loop])[0]
            self.advance(state, loop, preds)
        if ctx.taps_enabled:
            from omniloop.loop import StepContext

            sc = StepContext(request_id=state.request.request_id, node=ctx.node.name, step_index=loop.step,
                             num_steps=loop.total, timestep=loop.extra["t_values"][loop.step], branch="cond")
            ctx.tap("latents", loop.tensors["latents"], sc)
            ctx.tap("audio_latents", loop.tensors["audio_latents"], sc)
        return StepResult(done=loop.step + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        p: LTX2Resolved = params_of(state)
        metrics: dict[str, Any] = {"passes": list(p.passes), "transformer_calls": loop.total * len(p.passes),
                                   "compiled_blocks": blocks_for(ctx.components["transformer"], ctx) is not None}
        metrics.update(step_time_metrics(ctx, state) or {})
        state.metrics["denoise"] = metrics
        state.write("denoised", Latents(tensor=loop.tensors["latents"], modality="video"), ctx.node.name)
        state.write("audio_denoised", Latents(tensor=loop.tensors["audio_latents"], modality="audio"), ctx.node.name)
        for k in ("video_scheduler", "audio_scheduler"):
            loop.extra.pop(k, None)

    # -- batched steps ------------------------------------------------------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        """Equal for requests whose next step may run as one forward per pass, else None."""
        if ctx.taps_enabled or ctx.step_interceptors or state.request.exact or loop.step >= loop.total:
            return None
        p: LTX2Resolved = params_of(state)
        text = state.read("conditioning", Embeddings).tensor
        lat, alat = loop.tensors["latents"], loop.tensors["audio_latents"]
        return ("ltx2-denoise", "mask" in loop.tensors, tuple(lat.shape), tuple(alat.shape), str(lat.dtype), str(lat.device),
                tuple(text.shape), p.passes, p.stg_blocks, loop.extra["fps"], p.use_cross_timestep,
                (p.latent_frames, p.latent_height, p.latent_width, p.audio_frames), loop.step, loop.total,
                loop.extra["t_values"][loop.step], loop.extra["mu"])

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        if not loops:
            return []
        with torch.no_grad():
            preds = self.passes(ctxs[0], states, loops)
            for st, lp, mine in zip(states, loops, preds, strict=True):
                self.advance(st, lp, mine)
        return [StepResult(done=lp.step + 1 >= lp.total) for lp in loops]


__all__ = ["Denoise"]
