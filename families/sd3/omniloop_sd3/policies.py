"""The SD3 family's denoise policies: one :class:`omniloop_policies.PolicyMenu` per loaded model.

Defaults reproduce diffusers' ``StableDiffusion3Pipeline`` bit for bit: the sampler matching the
checkpoint's scheduler class (``flow-euler`` for ``FlowMatchEulerDiscreteScheduler``, with the
config's static ``shift`` — the policies' ``constant`` shift policy), the ``batched`` CFG policy
(diffusers runs the negative and the positive prompt as one batch of two — uncond rows first, as
the family stacks them), the scheduler step on the tensors as diffusers passes them
(``step_dtype`` native) and latents kept in the model's dtype between steps (diffusers draws and
keeps SD3 latents in the text encoders' dtype). A checkpoint whose scheduler config asks for
dynamic shifting gets the ``resolution`` shift policy from the same config (``mu`` from the
latent token count, as the pipeline computes it).

Deploy ``policies`` (same keys as the Wan family): ``sampler``, ``cfg``, ``samplers``, ``cfgs``,
``sampler_options``, ``cfg_options``, ``step_dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.family import LoadedModel
from omniloop_kit.policies import (
    DEPLOY_KEYS,
    MENU_KEY,
    NODE,
    cached_menu,
    deploy_policies,
    model_precision,
    scheduler_shift,
)
from omniloop_kit.policies import build_menu as kit_menu

DEFAULT_CFG = "batched"


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """omniloop-kit's menu with SD3's precision (latents in the model dtype) and shift policy
    (diffusers' SD3 pipelines: ``calculate_shift`` with ``max_shift`` 1.16 unless the config says)."""
    options = options or {}
    deploy = deploy_policies(options, "sd3")
    return kit_menu(model, options, deploy, default_cfg=DEFAULT_CFG, shift=scheduler_shift(model, {"max_shift": 1.16}),
                    precision=model_precision(model, deploy, latents=True))


def menu_for(model: LoadedModel, task: Any, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu for ``task`` (the default step count differs: 28 t2i, 50 i2i), cached."""
    from omniloop.request import TaskType

    task = TaskType(task)
    view = LoadedModel(family=model.family, path=model.path, components=model.components,
                       config={"defaults": model.config["task_defaults"][task]}, device=model.device, dtype=model.dtype)
    return cached_menu(model, lambda: build_menu(view, options if options is not None else model.config.get("options")),
                       key=task)


__all__ = ["DEFAULT_CFG", "DEPLOY_KEYS", "MENU_KEY", "NODE", "build_menu", "menu_for"]
