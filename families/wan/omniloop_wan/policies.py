"""The Wan family's denoise policies: one :class:`omniloop_policies.PolicyMenu` per loaded model.

The menu binds what a request of this checkpoint may choose between (samplers built from the
checkpoint's ``scheduler/scheduler_config.json``, CFG policies) plus the expert router (Wan2.2
A14B: ``boundary_ratio`` from ``model_index.json``) and the precision policy. It is built once
per loaded model — at ``load``, so an incompatible scheduler config is a load-time
``CheckpointError`` — and reused by every pipeline and request of that model.

Defaults reproduce diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` bit for bit: the
sampler matching the checkpoint's scheduler class, classic CFG, and the scheduler step on the
tensors as diffusers passes them (``step_dtype=None``: bf16 model output, fp32 latents).

The deploy config may change the node's defaults with ``policies`` (omniloop-kit's
``DeployPolicies``: ``sampler``, ``cfg``, ``samplers``, ``cfgs``, ``sampler_options``,
``cfg_options``, ``step_dtype``)::

    policies: {sampler: dpmpp, cfg: batched, cfg_options: {interval: {start: 0.0, end: 0.8}}}

A checkpoint's ``omniloop.json`` ``defaults`` may name the sampler it was tuned for and its options
(``sampler``, ``sampler_options``: wan-demo-fast's ``few-step`` schedule, wan-demo's stochastic
``flow-euler``) and its flow shift (``shift``, a number > 0: used when a request gives none,
instead of the scheduler config's); the deploy's ``policies`` win over the sampler defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.errors import DeployError
from omniloop.family import LoadedModel
from omniloop_kit.policies import DEPLOY_KEYS, MENU_KEY, NODE, cached_menu, deploy_policies, step_dtype
from omniloop_kit.policies import build_menu as kit_menu


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The :class:`~omniloop_policies.PolicyMenu` of ``model`` (not cached; see :func:`menu_for`):
    omniloop-kit's menu plus Wan's expert router (Wan2.2 ``boundary_ratio``), precision per
    expert, and the checkpoint's ``omniloop.json`` defaults (sampler, its options, shift)."""
    from omniloop_policies import BoundaryRouter, ConstantShift, PolicyError, PrecisionPolicy, SingleExpert

    options = options or {}
    cfg, comps = model.config, model.components
    deploy = deploy_policies(options, "wan")
    ntt = int(dict(comps["scheduler"].config).get("num_train_timesteps", 1000))
    router = BoundaryRouter.from_config(cfg.get("model_index") or {}, num_train_timesteps=ntt) or SingleExpert()
    dtypes = {name: comps[name].dtype for name in ("transformer", "transformer_2") if name in comps}
    precision = PrecisionPolicy(dtypes=dtypes, default_dtype=comps["transformer"].dtype, step_dtype=step_dtype(deploy))
    defaults = cfg["defaults"]
    try:
        # a checkpoint's omniloop.json may set its default flow shift (``defaults.shift``); a
        # request's shift wins, and without it the sampler keeps the scheduler config's
        shift = ConstantShift(default=defaults["shift"]) if defaults.get("shift") is not None else None
    except PolicyError as err:
        where = f"{model.path / 'omniloop.json'}: " if model.path is not None else ""
        raise DeployError(f"{where}defaults.shift: {err}") from None
    g2 = defaults.get("guidance_scale_2")
    # a checkpoint's omniloop.json defaults may name its sampler (a distilled few-step schedule);
    # the deploy's policies win
    return kit_menu(model, options, deploy, sampler_options=defaults.get("sampler_options"),
                    default_sampler=defaults.get("sampler"), default_cfg="classic", router=router, shift=shift,
                    precision=precision, default_guidance_scale_2=float(g2) if g2 is not None else None)


def menu_for(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu, built on first use and kept in ``model.config["policy_menu"]``."""
    return cached_menu(model, lambda: build_menu(model, options))


def latent_tokens(shape: tuple[int, ...], patch_size: tuple[int, int, int]) -> int:
    """Tokens the transformer sees for latents of ``shape`` ``[B, C, F, H, W]``."""
    p_t, p_h, p_w = patch_size
    return (shape[2] // p_t) * (shape[3] // p_h) * (shape[4] // p_w)


def describe(model: LoadedModel) -> dict[str, Any]:
    """What the denoise node offers on this model (samplers, CFG policies, defaults)."""
    return dict(menu_for(model).describe())


__all__ = ["DEPLOY_KEYS", "MENU_KEY", "NODE", "build_menu", "describe", "latent_tokens", "menu_for"]
