"""Sampler, guidance and expert routing — each one small function.

Today these are diffusers' defaults: the checkpoint's own scheduler (UniPC with flow sigmas, or
flow-matching Euler), a fresh instance per request, and classic CFG. They are kept apart so that
the policy plugins (samplers, CFG policies) can replace each one without touching the loop.
"""

from __future__ import annotations

from typing import Any

import torch


def make_scheduler(template: Any, shift: float | None = None) -> Any:
    """A fresh scheduler for one request, from the checkpoint's scheduler ``template``.

    ``shift`` overrides the flow shift (``flow_shift`` for UniPC, ``shift`` for flow Euler).
    The template itself is never stepped: schedulers keep per-run state.
    """
    config = dict(template.config)
    if shift is not None:
        if "flow_shift" in config:
            config["flow_shift"] = float(shift)
        if "shift" in config:
            config["shift"] = float(shift)
    return type(template).from_config(config)


def shift_of(template: Any) -> float | None:
    config = template.config
    value = config.get("flow_shift", config.get("shift"))
    return None if value is None else float(value)


def set_timesteps(scheduler: Any, steps: int, device: torch.device) -> torch.Tensor:
    """Prepare ``scheduler`` for ``steps`` steps and return its timesteps."""
    scheduler.set_timesteps(steps, device=device)
    scheduler.set_begin_index(0)
    return scheduler.timesteps


def sampler_step(scheduler: Any, model_output: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """One solver step: the latents at the next timestep."""
    return scheduler.step(model_output, timestep, latents, return_dict=False)[0]


def cfg_branches(guidance_scale: float) -> tuple[str, ...]:
    """Guidance branches for classic CFG: an unconditional branch only when guidance > 1."""
    return ("cond", "uncond") if guidance_scale > 1.0 else ("cond",)


def classic_cfg(preds: dict[str, torch.Tensor], guidance_scale: float) -> torch.Tensor:
    """``uncond + g * (cond - uncond)`` (diffusers' order of operations, for bit parity)."""
    if "uncond" not in preds:
        return preds["cond"]
    uncond = preds["uncond"]
    return uncond + guidance_scale * (preds["cond"] - uncond)


def route_expert(timestep: torch.Tensor, boundary_timestep: float | None) -> str:
    """Wan2.2 A14B: the high-noise ``transformer`` for ``t >= boundary``, then ``transformer_2``."""
    if boundary_timestep is None or timestep >= boundary_timestep:
        return "transformer"
    return "transformer_2"
