"""Post-training on the serving runtime: the rollout a request asks for, recorded.

A request with ``rollout: {kind, noise_level, sde_steps, capture, ...}`` (``omniloop.request.
RolloutParams``) runs its denoise loop with a rollout step instead of the sampler's update; the
runtime installs a :class:`RolloutRecorder` on each loop the family declares (:class:`RolloutSupport`),
the family's step takes the step on it (omniloop-policies' ``omniloop_policies.rollout``: the step
math, the formulas of ``docs/rl.md``), and the output carries ``artifacts["trajectory"]``
(:class:`Trajectory`) and ``metrics["weight_version"]``. What a trainer computes is omniloop-rl's
``omniloop_rl.trainer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from attrs import define

from .artifacts import Artifact
from .errors import RequestError
from .lazy import moved
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
        #: replay: the loop whose state it puts back (set by :meth:`before_step`)
        self.loop: Any = None
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
            self.loop = loop
            loop.tensors[key] = self.recorded(index, loop, loop.tensors[key])

    def record(self, latents: torch.Tensor, nxt: torch.Tensor, log_prob: torch.Tensor | None, noisy: bool,
               sigmas: Sequence[float], timesteps: Sequence[float]) -> None:
        """Record one step ``latents -> nxt`` on the schedule ``sigmas``/``timesteps``: whether it
        was stochastic and its log-prob (None: not captured), as ``omniloop_policies.rollout``
        took it."""
        if not self.sigmas:
            self.sigmas, self.timesteps = tuple(sigmas), tuple(timesteps)
        if "latents" in self.capture or self.replay is not None:
            if not self.states:
                self.states.append(latents.detach().float().cpu().clone())
            self.states.append(nxt.detach().float().cpu().clone())
        if self.kind != "ode" and "log_probs" in self.capture:
            self.log_probs.append(log_prob.float().cpu() if log_prob is not None else torch.zeros(latents.shape[0]))
            self.mask.append(noisy)

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
#: and the rollout step math to omniloop-policies (``omniloop_policies.rollout``: the family's step takes it)
__getattr__ = moved(__name__, {
    **dict.fromkeys(("step_log_prob", "nft_optimality", "nft_noisy", "nft_loss", "replay_log_probs", "as_params_dict"),
                    "omniloop_rl.trainer"),
    **dict.fromkeys(("step_stats", "gaussian_log_prob"), "omniloop_policies.rollout"),
})


__all__ = [
    "CAPTURES", "KINDS", "ROLLOUT_KEY", "RolloutRecorder", "RolloutSupport", "Trajectory", "check_rollout",
    "family_rollout_support", "noise_seed",
]
