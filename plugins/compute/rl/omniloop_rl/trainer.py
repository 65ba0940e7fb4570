"""What a post-training trainer computes against a serving runtime (omniloop-rl; the core's
``omniloop.rl`` until omniloop 0.2, issue 34): a recorded transition's log-prob from its own forward
(:func:`step_log_prob`, Flow-GRPO's ratio), the DiffusionNFT objective (:func:`nft_optimality`,
:func:`nft_noisy`, :func:`nft_loss`), and a teacher-forced replay of a rollout through the runtime
(:func:`replay_log_probs`, consistency level C1). The rollout step math itself
(:func:`omniloop_policies.rollout.step_stats`, :func:`~omniloop_policies.rollout.gaussian_log_prob`)
is omniloop-policies': the family's denoise step takes those steps. The formulas are stated in ``docs/rl.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from omniloop.errors import RequestError
from omniloop.rl import Trajectory
from omniloop_policies.rollout import gaussian_log_prob, step_stats


def step_log_prob(
    velocity: torch.Tensor, latents: torch.Tensor, next_latents: torch.Tensor,
    sigma: float | torch.Tensor, sigma_next: float | torch.Tensor, *, kind: str = "sde", noise_level: float = 0.7,
    sigma_max: float | torch.Tensor,
) -> torch.Tensor:
    """The log-prob ``[B]`` of a recorded transition ``latents -> next_latents`` given a freshly
    computed (guided) ``velocity`` — what a trainer calls on its own forward (gradients flow
    through ``velocity``). ``sigma``/``sigma_next`` are ``trajectory.sigmas[i]``/``[i + 1]``,
    ``sigma_max`` is ``trajectory.sigmas[1]``; all tensors in the layout the velocity was
    computed in (unpack or pack both alike)."""
    mean, scale = step_stats(velocity, latents, sigma, sigma_next, kind=kind, noise_level=noise_level, sigma_max=sigma_max)
    return gaussian_log_prob(next_latents, mean, scale, kind=kind)


# ---------------------------------------------------------------------------------------------
# DiffusionNFT (a trainer-side objective on clean samples; no log-probs)
# ---------------------------------------------------------------------------------------------


def nft_optimality(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r = clamp(A, -clip, clip) / (2·clip) + 1/2`` in
    ``[0, 1]`` from group-normalised advantages ``A``."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    return (advantages.float().clamp(-clip, clip) / (2 * clip) + 0.5).clamp(0.0, 1.0)


def nft_noisy(clean: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """The forward (noising) process of rectified flow: ``x_σ = (1 - σ)·x0 + σ·ε``; ``sigma`` a
    scalar or one per sample."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=clean.device)
    s = s.reshape(-1, *([1] * (clean.ndim - 1))) if s.ndim else s
    return (1 - s) * clean.float() + s * noise.float()


def nft_loss(
    velocity: torch.Tensor, old_velocity: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor,
    sigma: float | torch.Tensor, optimality: torch.Tensor, *, beta: float = 1.0, adaptive: bool = True,
) -> torch.Tensor:
    """DiffusionNFT's per-sample loss ``[B]`` (Zheng et al. 2025, arXiv:2509.16117, eq. of its
    policy-improvement objective; written from the paper): with ``v`` the trained policy's velocity
    at ``x_σ`` (:func:`nft_noisy` of a rollout's clean sample ``x0``), ``v_old`` the rollout
    policy's (no gradient) and ``r`` the optimality (:func:`nft_optimality`)::

        v+ = (1 - β)·v_old + β·v          v- = (1 + β)·v_old - β·v
        x0± = x_σ - σ·v±
        loss = (r·|x0+ - x0|² / w+  +  (1 - r)·|x0- - x0|² / w-) / β      (means over non-batch dims)

    ``w±`` the detached mean ``|x0± - x0|`` per sample when ``adaptive`` (the paper's adaptive
    weighting), else 1. Minimising it moves ``v`` towards the target velocity ``ε - x0`` on
    samples with ``r = 1`` and away from it on samples with ``r = 0``, each relative to ``v_old``.
    Float32; differentiable in ``velocity``."""
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta}")
    v, v_old = velocity.float(), old_velocity.detach().float()
    x, x0 = noisy.detach().float(), clean.detach().float()
    s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    s = s.reshape(-1, *([1] * (x.ndim - 1))) if s.ndim else s
    r = optimality.detach().float().reshape(-1)
    dims = tuple(range(1, x.ndim))

    def per_sample(t: torch.Tensor) -> torch.Tensor:
        return t.mean(dim=dims) if dims else t  # (mean over dim=() would reduce everything)

    def term(v_implicit: torch.Tensor) -> torch.Tensor:
        err = x - s * v_implicit - x0
        sq = per_sample(err**2)
        if adaptive:
            sq = sq / per_sample(err.detach().abs()).clamp(min=1e-5)
        return sq

    positive = term((1 - beta) * v_old + beta * v)
    negative = term((1 + beta) * v_old - beta * v)
    return (r * positive + (1 - r) * negative) / beta


def replay_log_probs(runtime: Any, request: Any, trajectory: Trajectory) -> torch.Tensor:
    """Re-run ``request`` (the rollout's request, same seed) on ``runtime`` with ``trajectory``'s
    latents teacher-forced: every step is a fresh forward on the recorded state, and the
    log-prob of the recorded transition is recomputed. Returns ``[S]`` float32 (C1: equals
    ``trajectory.log_probs`` when the weights are the same)."""
    if trajectory.latents.numel() == 0:
        raise RequestError("rollout.capture", "replay needs the trajectory's latents (capture 'latents')")
    out = runtime.generate_replay(request, trajectory)
    traj = out.artifacts.get("trajectory")
    if not out.ok or traj is None:
        msg = out.error.message if out.error is not None else "no trajectory"
        raise RuntimeError(f"replay failed: {msg}")
    return traj.log_probs  # type: ignore[no-any-return]


def as_params_dict(params: Any) -> Mapping[str, Any]:
    return attrs.asdict(params)


__all__ = ["as_params_dict", "nft_loss", "nft_noisy", "nft_optimality", "replay_log_probs", "step_log_prob"]
