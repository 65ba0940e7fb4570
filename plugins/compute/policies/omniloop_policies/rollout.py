"""The rollout step a post-training request takes in a flow-matching denoise loop, with its exact
per-step log-probability (the core's ``omniloop.rl`` until omniloop 0.2, issue 34: the core keeps
the request's recorder and its trajectory, this library the step math).

A request with ``rollout: {kind, noise_level, sde_steps, capture, ...}`` (``omniloop.request.
RolloutParams``) runs its denoise loop with this step instead of the sampler's update
(:meth:`~omniloop_policies.DenoisePolicies.advance_rollout`): the sampler still gives the schedule
(timesteps, sigmas, shift), the CFG policy the guided velocity ``v``, LoRA adapters apply as usual,
and then :func:`rollout_step` takes the step ``x -> x'`` in float32 and records the log-probability
of ``x'`` under the step's Gaussian on the request's :class:`omniloop.rl.RolloutRecorder`.

The formulas follow Flow-GRPO's reference code (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``,
``sde_step_with_logprob``; written here from the formulas, not copied) and are stated in
``docs/rl.md``. With ``σ`` the step's sigma, ``σ'`` the next one, ``dt = σ' - σ`` (negative),
``a`` the noise level and ``σ_max`` the schedule's second sigma:

* ``sde``: ``std = a·sqrt(σ / (1 - σ''))`` where ``σ''`` is ``σ`` except that ``σ = 1`` becomes
  ``σ_max`` (denominator only); ``mean = x·(1 + std²/(2σ)·dt) + v·(1 + std²(1-σ)/(2σ))·dt``;
  ``x' = mean + std·sqrt(-dt)·ε``; ``log p = log N(x'; mean, std²·(-dt))`` averaged over every
  dimension but the batch.
* ``cps`` (coefficient-preserving): ``std = σ'·sin(a·π/2)``; ``x0 = x - σ·v``, ``x1 = x + (1-σ)·v``;
  ``mean = (1-σ')·x0 + sqrt(σ'² - std²)·x1``; ``x' = mean + std·ε``; ``log p = -(x' - mean)²``
  averaged (Flow-GRPO drops every constant for CPS, so it is a log-density up to a constant).
* ``ode`` (and the steps of an ``sde``/``cps`` rollout outside ``sde_steps``): ``x' = x + v·dt``, no
  log-probability (0 in ``log_probs`` with ``sde_mask`` False).

:func:`omniloop_rl.trainer.step_log_prob` (omniloop-rl, what a trainer imports) recomputes one
recorded transition's log-prob from a velocity a trainer computed with its own forward (with
gradients); :func:`omniloop_rl.trainer.replay_log_probs` re-runs a request through the runtime
with its recorded trajectory teacher-forced and returns the recomputed log-probs — consistency
level C1 says they equal the rollout's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from omniloop.rl import KINDS, RolloutRecorder


def _f32(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=like.device)


def step_stats(
    velocity: torch.Tensor, latents: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor,
    *, kind: str, noise_level: float, sigma_max: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, scale)`` of the step's Gaussian ``x' ~ N(mean, scale²)`` in float32: ``scale`` is
    ``std·sqrt(-dt)`` for ``sde``, ``std`` for ``cps``, 0 for ``ode``. Differentiable in
    ``velocity`` (trainers call it inside autograd)."""
    v, x = velocity.float(), latents.float()
    s, s_next = _f32(sigma, x), _f32(sigma_next, x)
    dt = s_next - s
    if kind == "ode":
        return x + v * dt, torch.zeros((), dtype=torch.float32, device=x.device)
    if kind == "sde":
        denom_sigma = torch.where(s == 1, _f32(sigma_max, x), s)
        std = torch.sqrt(s / (1 - denom_sigma)) * noise_level
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        return mean, std * torch.sqrt(-dt)
    if kind == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)
        return mean, std
    raise ValueError(f"rollout kind must be one of {', '.join(KINDS)}, got {kind!r}")


def gaussian_log_prob(next_latents: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, *, kind: str) -> torch.Tensor:
    """The per-sample log-prob ``[B]`` of ``next_latents`` (float32), averaged over non-batch dims:
    ``log N(x'; mean, scale²)`` for ``sde``; ``-(x' - mean)²`` for ``cps`` (Flow-GRPO's, constants dropped)."""
    xn = next_latents.float().detach()
    if kind == "sde":
        lp = -((xn - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    elif kind == "cps":
        lp = -((xn - mean) ** 2)
    else:
        raise ValueError(f"no log-prob for rollout kind {kind!r}")
    return lp.mean(dim=tuple(range(1, lp.ndim))) if lp.ndim > 1 else lp


def rollout_step(rec: RolloutRecorder, index: int, velocity: torch.Tensor, latents: torch.Tensor,
                 sigmas: Sequence[float], timesteps: Sequence[float]) -> torch.Tensor:
    """The rollout step ``index`` of the request ``rec`` records, from ``latents`` with the guided
    ``velocity``: the next latents in ``latents``' dtype (in replay, the recorded ones); ``rec``
    records the state and the log-prob."""
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    sigma_max = sigmas[1] if len(sigmas) > 1 else sigmas[0]
    noisy = rec.stochastic(index)
    kind = rec.kind if noisy else "ode"
    with torch.no_grad():
        mean, scale = step_stats(velocity, latents, sigma, sigma_next, kind=kind,
                                 noise_level=rec.noise_level, sigma_max=sigma_max)
        nxt: torch.Tensor
        if rec.replay is not None:
            nxt = rec.recorded(index + 1, rec.loop, latents)
        elif noisy:
            gen = rec.generator
            eps = torch.randn(mean.shape, generator=gen, dtype=torch.float32, device=gen.device if gen is not None else "cpu")
            nxt = (mean + scale * eps.to(mean.device)).to(latents.dtype)
        else:
            nxt = mean.to(latents.dtype)
        # the log-prob of what the loop really holds next (after the cast to its dtype): C1 in any dtype
        lp = gaussian_log_prob(nxt, mean, scale, kind=kind) if noisy and "log_probs" in rec.capture else None
    rec.record(latents, nxt, lp, noisy, sigmas, timesteps)
    return nxt


__all__ = ["gaussian_log_prob", "rollout_step", "step_stats"]
