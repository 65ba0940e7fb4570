"""Test helpers: a tiny deterministic denoiser and a reference denoise loop over the policy API.

:class:`ToyDenoiseLoop` is written the way a family's ``LoopStage`` uses the policies (resolve at
request time, ``init`` into a ``LoopState``, then ``step_context`` → ``predict`` → ``advance``), so
it doubles as an executable example. It runs on CPU in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omniloop.loop import LoopState, StepContext

from .bundle import DenoisePolicies, PolicyMenu
from .cfg import stack_forward

#: diffusers' Wan2.1 scheduler config (scheduler/scheduler_config.json of the -Diffusers repos)
WAN_UNIPC_CONFIG: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler",
    "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


class ToyDenoiser(torch.nn.Module):
    """A deterministic velocity model ``f(x, t, embeds[, guidance])`` with Linear layers.

    ``x``: ``[B, C, *spatial]``; ``t``: ``[B]`` or a scalar; ``embeds``: ``[B, L, D]``."""

    def __init__(self, channels: int = 4, embed_dim: int = 8, hidden: int = 32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.channels = channels
        self.hidden = hidden
        self.inp = torch.nn.Linear(channels, hidden)
        self.emb = torch.nn.Linear(embed_dim, hidden)
        self.out = torch.nn.Linear(hidden, channels)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.requires_grad_(False)
        self.forwards = 0
        self.batch_sizes: list[int] = []

    def forward(
        self, x: torch.Tensor, t: torch.Tensor | float, embeds: torch.Tensor, guidance: float | None = None
    ) -> torch.Tensor:
        self.forwards += 1
        self.batch_sizes.append(int(x.shape[0]))
        b, c = x.shape[:2]
        t = torch.as_tensor(t, dtype=torch.float32).reshape(-1).expand(b)
        h = x.reshape(b, c, -1).transpose(1, 2)
        freqs = torch.arange(1, self.hidden + 1, dtype=torch.float32)
        temb = torch.sin(t[:, None] / 1000.0 * freqs[None, :] * math.pi)
        h = self.inp(h) + self.emb(embeds.mean(dim=1))[:, None, :] + temb[:, None, :].to(h.dtype)
        if guidance is not None:
            h = h * (1.0 + 0.01 * guidance)
        h = torch.nn.functional.gelu(h)
        out: torch.Tensor = self.out(h).transpose(1, 2).reshape(x.shape)
        return out


class ToyDenoiseLoop:
    """A denoise loop over the policy API, as a family writes it."""

    def __init__(
        self,
        menu: PolicyMenu,
        models: Mapping[str, ToyDenoiser] | ToyDenoiser,
        *,
        shape: Sequence[int] = (1, 4, 2, 4, 4),
        embed_len: int = 6,
        embed_dim: int = 8,
        node: str = "denoise",
    ) -> None:
        self.menu = menu
        if isinstance(models, ToyDenoiser):
            models = {e: models for e in menu.router.experts}
        self.models = dict(models)
        self.shape = tuple(shape)
        self.embed_len = embed_len
        self.embed_dim = embed_dim
        self.node = node
        self.interceptors: tuple[Any, ...] = ()

    def init(self, request: Any, *, seed: int, request_id: str = "r") -> LoopState:
        pol: DenoisePolicies = self.menu.resolve(request)
        gen = torch.Generator().manual_seed(seed)
        loop = LoopState()
        loop.extra["request_id"] = request_id
        loop.extra["generator"] = gen
        latents = torch.randn(self.shape, generator=gen, dtype=torch.float32)
        loop.tensors["latents"] = latents
        loop.tensors["cond"] = torch.randn((self.shape[0], self.embed_len, self.embed_dim), generator=gen)
        loop.tensors["uncond"] = torch.randn((self.shape[0], self.embed_len, self.embed_dim), generator=gen)
        seq_len = int(torch.tensor(self.shape[2:]).prod())
        pol.init(loop, device="cpu", generator=gen, seq_len=seq_len)
        for icpt in self.interceptors:
            for branch in loop.branches:
                ctx = StepContext(
                    request_id=request_id,
                    node=self.node,
                    step_index=0,
                    num_steps=loop.total,
                    timestep=0.0,
                    branch=branch,
                )
                loop.plugin_state[(icpt.name, branch)] = icpt.open(ctx, loop)
        return loop

    def step(self, loop: LoopState) -> bool:
        pol: DenoisePolicies = loop.policy_state["policies"]
        step = pol.step_context(loop, request_id=loop.extra["request_id"], node=self.node)
        assert step.expert is not None  # the router always names one
        model = self.models[step.expert]
        x = loop.tensors["latents"]
        dtype = pol.precision.dtype_for(step.expert)
        xin = x.to(dtype)
        t = pol.timestep(loop).expand(x.shape[0])
        embeds = {"cond": loop.tensors["cond"].to(dtype), "uncond": loop.tensors["uncond"].to(dtype)}
        guidance = pol.model_guidance(step, loop)

        def forward(s: Any) -> torch.Tensor:
            out: torch.Tensor = model(xin, t, embeds[s.branch], guidance)
            return out

        def batch_model(xb: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = model(xb, t.repeat(xb.shape[0] // x.shape[0]), eb, guidance)
            return out

        guided = pol.predict(
            step,
            loop,
            forward=forward,
            forward_batch=stack_forward(batch_model, xin, embeds),
            interceptors=self.interceptors,
        )
        loop.tensors["latents"] = pol.advance(step, loop, guided, x)  # type: ignore[arg-type]
        loop.step += 1
        loop.done = pol.done(loop)
        return bool(loop.done)

    def run(self, request: Any, *, seed: int, request_id: str = "r") -> torch.Tensor:
        loop = self.init(request, seed=seed, request_id=request_id)
        while not self.step(loop):
            pass
        out: torch.Tensor = loop.tensors["latents"]
        return out
