"""Post-training on the serving runtime: rollout steps with exact per-step log-probabilities.

A request with ``rollout: {kind, noise_level, sde_steps, capture, ...}`` (``omniloop.request.
RolloutParams``) runs its denoise loop with the runtime-owned rollout step instead of the sampler's
update: the sampler still gives the schedule (timesteps, sigmas, shift), the CFG policy the guided
velocity ``v``, LoRA adapters apply as usual, and then this module takes the step ``x -> x'`` in
float32 and records the log-probability of ``x'`` under the step's Gaussian. The output carries
``artifacts["trajectory"]`` (:class:`Trajectory`) and ``metrics["weight_version"]``.

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
gradients); :func:`omniloop_rl.trainer.replay_log_probs` re-runs a request
through the runtime with its recorded trajectory teacher-forced (a fresh forward per step on the
recorded state) and returns the recomputed log-probs — consistency level C1 says they equal the
rollout's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from attrs import define

from .artifacts import Artifact
from .errors import RequestError
from .loop import LoopState

#: ``LoopState.extra`` key of a request's rollout recorder (read by the policies' ``finish_step``)
ROLLOUT_KEY = "rollout"
KINDS = ("sde", "cps", "ode")
CAPTURES = ("latents", "log_probs", "timesteps")


@define(frozen=True)
class RolloutSupport:
    """A family's declaration that its denoise loops run rollout steps (flow matching; the family
    calls ``omniloop_policies.stepping.finish_step``).

    ``nodes``: the loop nodes that run them. ``unpack(latents, loop)``: the loop's latents (as the
    loop holds them, batch dim first) in the family's unpacked layout (None: already unpacked);
    ``pack(latents, loop)`` its inverse (for ``omniloop_rl.trainer.replay_log_probs``)."""

    nodes: tuple[str, ...] = ("denoise",)
    unpack: Callable[[torch.Tensor, LoopState], torch.Tensor] | None = None
    pack: Callable[[torch.Tensor, LoopState], torch.Tensor] | None = None


def family_rollout_support(family: Any) -> RolloutSupport | None:
    """The family's ``capabilities.rollout_support`` (None: it cannot run rollouts)."""
    from .capabilities import capabilities_of

    support = capabilities_of(family).rollout_support
    return support if isinstance(support, RolloutSupport) else None


@define(kw_only=True)
class Trajectory(Artifact):
    """A rollout's recorded trajectory (CPU tensors).

    ``latents`` ``[S+1, ...]``: the state before every step plus the final one, float32, in the
    family's unpacked latent layout without the batch dim of one (empty when not captured);
    ``log_probs`` ``[S]`` float32 (0-length when not captured or ``kind: ode``); ``sde_mask``
    ``[S]`` bool: the steps that were stochastic (log-probs elsewhere are 0); ``sigmas`` ``[S+1]``
    and ``timesteps`` ``[S]`` float32 (the model's timestep per step); ``kind``/``noise_level`` as
    run; ``weight_version`` the weights it ran on."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    sde_mask: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    kind: str = "sde"
    noise_level: float = 0.7
    weight_version: str = ""


# ---------------------------------------------------------------------------------------------
# The step math (float32)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The per-request recorder the runtime installs on a loop
# ---------------------------------------------------------------------------------------------


class RolloutRecorder:
    """One request's rollout: takes each step (``step``), records the trajectory, and in replay mode
    teacher-forces a recorded one (``replay``: the recorded latents in the loop's own layout)."""

    def __init__(self, params: Any, generator: torch.Generator | None, *, weight_version: str = "",
                 support: RolloutSupport | None = None, replay: torch.Tensor | None = None) -> None:
        self.kind: str = params.kind
        self.noise_level: float = float(params.noise_level)
        self.sde_steps: frozenset[int] | None = None if params.sde_steps is None else frozenset(params.sde_steps)
        self.capture = frozenset(params.capture)
        self.generator = generator
        self.weight_version = weight_version
        self.support = support
        #: replay: the recorded latents ``[S+1, ...]`` (unpacked layout, as in the trajectory)
        self.replay = replay
        self._loop: Any = None
        self.states: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.mask: list[bool] = []
        self.sigmas: tuple[float, ...] = ()
        self.timesteps: tuple[float, ...] = ()

    def stochastic(self, index: int) -> bool:
        return self.kind != "ode" and (self.sde_steps is None or index in self.sde_steps)

    def recorded(self, index: int, loop: LoopState, like: torch.Tensor) -> torch.Tensor:
        """Replay: the recorded state ``index`` in the loop's own layout, device and dtype."""
        assert self.replay is not None
        x = self.replay[index:index + 1]
        if self.support is not None and self.support.pack is not None:
            x = self.support.pack(x, loop)
        return x.to(device=like.device, dtype=like.dtype).reshape(like.shape)

    def before_step(self, index: int, loop: LoopState, key: str = "latents") -> None:
        """Replay: put the recorded state of step ``index`` into the loop before its forward."""
        if self.replay is not None:
            self._loop = loop
            loop.tensors[key] = self.recorded(index, loop, loop.tensors[key])

    def step(self, index: int, velocity: torch.Tensor, latents: torch.Tensor, sigmas: Sequence[float],
             timesteps: Sequence[float]) -> torch.Tensor:
        """The rollout step ``index`` from ``latents`` with the guided ``velocity``: the next
        latents in ``latents``' dtype; records state and log-prob."""
        if not self.sigmas:
            self.sigmas, self.timesteps = tuple(sigmas), tuple(timesteps)
        sigma, sigma_next = sigmas[index], sigmas[index + 1]
        sigma_max = sigmas[1] if len(sigmas) > 1 else sigmas[0]
        noisy = self.stochastic(index)
        kind = self.kind if noisy else "ode"
        with torch.no_grad():
            mean, scale = step_stats(velocity, latents, sigma, sigma_next, kind=kind,
                                     noise_level=self.noise_level, sigma_max=sigma_max)
            if self.replay is not None:
                nxt = self.recorded(index + 1, self._loop, latents)
            elif noisy:
                eps = torch.randn(mean.shape, generator=self.generator, dtype=torch.float32,
                                  device=self.generator.device if self.generator is not None else "cpu")
                nxt = (mean + scale * eps.to(mean.device)).to(latents.dtype)
            else:
                nxt = mean.to(latents.dtype)
            # the log-prob of what the loop really holds next (after the cast to its dtype): C1 in any dtype
            lp = gaussian_log_prob(nxt, mean, scale, kind=kind) if noisy and "log_probs" in self.capture else None
        if "latents" in self.capture or self.replay is not None:
            if not self.states:
                self.states.append(latents.detach().float().cpu().clone())
            self.states.append(nxt.detach().float().cpu().clone())
        if self.kind != "ode" and "log_probs" in self.capture:
            self.log_probs.append(lp.float().cpu() if lp is not None else torch.zeros(latents.shape[0]))
            self.mask.append(noisy)
        return nxt

    def trajectory(self, loop: LoopState) -> Trajectory:
        support = self.support
        if self.states:
            states = self.states
            if support is not None and support.unpack is not None:
                states = [support.unpack(s, loop) for s in states]
            latents = torch.cat(states, dim=0) if states[0].shape[0] == 1 else torch.stack(states, dim=0)
        else:
            latents = torch.zeros(0)
        if self.log_probs:
            lps = torch.cat([lp.reshape(-1) for lp in self.log_probs]) if self.log_probs[0].numel() == 1 else torch.stack(self.log_probs)
        else:
            lps = torch.zeros(0)
        timesteps = torch.tensor(self.timesteps, dtype=torch.float32) if "timesteps" in self.capture else torch.zeros(0)
        return Trajectory(
            latents=latents, log_probs=lps.float(), sde_mask=torch.tensor(self.mask, dtype=torch.bool),
            sigmas=torch.tensor(self.sigmas, dtype=torch.float32), timesteps=timesteps,
            kind=self.kind, noise_level=self.noise_level, weight_version=self.weight_version,
        )


def noise_seed(seed: int, index: int) -> int:
    """The SDE-noise seed of sample ``index`` when a group shares its initial noise
    (``rollout.same_initial_noise``): a fixed mix of ``seed + index``, so that sample 0's SDE noise
    is not its initial noise drawn again."""
    return ((seed + index) ^ 0x5851F42D4C957F2D) & (2**63 - 1)


def check_rollout(params: Any, steps: int) -> None:
    """Range checks that need the request's step count; raises :class:`RequestError` naming the field."""
    if params.sde_steps is not None:
        seen: set[int] = set()
        for i, s in enumerate(params.sde_steps):
            if not 0 <= s < steps:
                raise RequestError(f"rollout.sde_steps.{i}", f"step {s} is out of range for a {steps}-step request (0 to {steps - 1})")
            if s in seen:
                raise RequestError(f"rollout.sde_steps.{i}", f"step {s} is listed twice")
            seen.add(s)
        if params.kind == "ode" and params.sde_steps:
            raise RequestError("rollout.sde_steps", "an ode rollout takes no stochastic steps; drop sde_steps or use kind sde/cps")


#: moved to omniloop-rl (``omniloop_rl.trainer``: what a trainer computes) in omniloop 0.2 (issue 34)
_MOVED = frozenset({"step_log_prob", "nft_optimality", "nft_noisy", "nft_loss", "replay_log_probs", "as_params_dict"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise ImportError(f"omniloop.rl.{name} moved to the omniloop-rl package: "
                          f"from omniloop_rl.trainer import {name} (pip install omniloop-rl)")
    raise AttributeError(f"module 'omniloop.rl' has no attribute {name!r}")


__all__ = [
    "CAPTURES", "KINDS", "ROLLOUT_KEY", "RolloutRecorder", "RolloutSupport", "Trajectory", "check_rollout",
    "family_rollout_support", "gaussian_log_prob", "noise_seed", "step_stats",
]
