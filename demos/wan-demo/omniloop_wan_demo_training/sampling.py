"""Batched GPU evaluation with the runtime's ``flow-euler`` sampler math (deterministic or with
``stochastic_sampling``), for ``training.v2 --phases eval`` (``--eval-v2 STEPS/G[/SHIFT]@euler``
or ``@euler-sde``).

The runtime runs one request per clip; evaluating 1 536 clips that way on the GPU takes minutes.
:class:`FlowEulerGenerator` runs the same math on a batch: the schedule of diffusers'
``FlowMatchEulerDiscreteScheduler(shift=SHIFT)`` (what the Wan family's ``flow-euler`` sampler
builds from the checkpoint's scheduler config), classic CFG (``u + g (c - u)``, the unconditional
forward skipped at ``g <= 1`` as WanPipeline does) and, per clip, a CPU ``torch.Generator(seed)``
that draws the initial latents and then one noise per step — the draws the runtime makes from the
request's generator (``omniloop_wan.denoise`` / ``FlowMatchEulerDiscreteScheduler.step``). So a
clip here is the runtime's clip up to kernel roundoff.

Stochastic sampling (``stochastic=True``, diffusers' ``stochastic_sampling``): each step predicts
``x0 = x - s_i v`` and re-noises to the next sigma with fresh noise,
``x = (1 - s_{i+1}) x0 + s_{i+1} n``, instead of the ODE step ``x + (s_{i+1} - s_i) v``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: the sampler names ``--eval-v2`` entries may end with (``@NAME``)
EVAL_SAMPLERS = ("unipc", "euler", "euler-sde")


def euler_schedule(steps: int, shift: float) -> tuple[list[float], list[float]]:
    """``(model timesteps, sigmas + terminal 0)`` of ``FlowMatchEulerDiscreteScheduler`` with
    ``shift`` over ``steps`` steps (the runtime's ``flow-euler`` sampler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))
    sched.set_timesteps(int(steps))
    return [float(t) for t in sched.timesteps.tolist()], [float(s) for s in sched.sigmas.tolist()]


class FlowEulerGenerator:
    """Clips from a WanPipeline's modules (``pipe.transformer``, ``text_encoder``, ``vae``) with
    the ``flow-euler`` sampler's math, batched; see the module docstring."""

    def __init__(self, pipe, tokenizer, *, device: str, shift: float, stochastic: bool, batch_size: int = 192,
                 latent_shape: tuple[int, ...] = (1, 16, 5, 16, 16)):
        self.tr, self.te, self.vae, self.tok = pipe.transformer, pipe.text_encoder, pipe.vae, tokenizer
        self.device, self.shift, self.stochastic = device, float(shift), bool(stochastic)
        self.batch_size, self.latent_shape = batch_size, tuple(latent_shape)

    @torch.no_grad()
    def latents(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> torch.Tensor:
        """The sampled latents, normalised as the DiT sees them (``[N, *latent_shape[1:]]`` on the device)."""
        from .distill import _embed

        timesteps, sigmas = euler_schedule(steps, self.shift)
        cfg = guidance_scale > 1.0
        emb_u = _embed(self.te, self.tok, [""], self.device) if cfg else None
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), self.batch_size):
            ps, ss = list(prompts[i : i + self.batch_size]), list(seeds[i : i + self.batch_size])
            gens = [torch.Generator("cpu").manual_seed(int(s)) for s in ss]

            def draw(gens: list[torch.Generator] = gens) -> torch.Tensor:
                return torch.cat([torch.randn(self.latent_shape, generator=g) for g in gens]).to(self.device)

            emb = _embed(self.te, self.tok, ps, self.device)
            if cfg:
                emb = torch.cat([emb, emb_u.expand(len(ps), -1, -1)])
            x = draw()
            for j, t in enumerate(timesteps):
                s, sn = sigmas[j], sigmas[j + 1]
                inp = torch.cat([x, x]) if cfg else x
                tt = torch.full((inp.shape[0],), t, device=self.device)
                v = self.tr(hidden_states=inp, timestep=tt, encoder_hidden_states=emb, return_dict=False)[0].float()
                if cfg:
                    vc, vu = v.chunk(2)
                    v = vu + guidance_scale * (vc - vu)
                if self.stochastic:
                    x0 = x - s * v
                    x = (1.0 - sn) * x0 + sn * draw()
                else:
                    x = x + (sn - s) * v
            out.append(x)
        return torch.cat(out)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        from .distill import _stats
        from .render import to_uint8_frames

        lat = self.latents(prompts, seeds, steps=steps, guidance_scale=guidance_scale)
        mean, std = _stats(self.vae, self.device)
        out: list[np.ndarray] = []
        for i in range(0, len(lat), self.batch_size):
            video = self.vae.decode((lat[i : i + self.batch_size] * std + mean).to(self.vae.dtype)).sample.float().clamp(-1, 1)
            out.extend(to_uint8_frames((v + 1) / 2) for v in video)
        return out
