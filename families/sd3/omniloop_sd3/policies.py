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

from omniloop.errors import DeployError
from omniloop.family import LoadedModel, PolicySpec

DEPLOY_KEYS = ("sampler", "cfg", "samplers", "cfgs", "sampler_options", "cfg_options", "step_dtype")
MENU_KEY = "policy_menu"
NODE = "denoise"
DEFAULT_CFG = "batched"


def _registry_specs(options: Mapping[str, Any]) -> dict[str, PolicySpec]:
    from omniloop_policies.plugin import builtin_specs

    specs = {s.name: s for s in builtin_specs()}
    policies = getattr(options.get("registry"), "policies", None)
    if isinstance(policies, Mapping):
        specs.update(policies)
    return specs


def _deploy_policies(options: Mapping[str, Any]) -> dict[str, Any]:
    raw = getattr(options.get("deploy"), "policies", None) or {}
    if not isinstance(raw, Mapping):
        raise DeployError(f"policies: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(DEPLOY_KEYS))
    if unknown:
        raise DeployError(f"policies.{unknown[0]}: unknown key for the sd3 family (known: {', '.join(DEPLOY_KEYS)})")
    for key in ("sampler", "cfg"):
        if key in raw and not isinstance(raw[key], str):
            raise DeployError(f"policies.{key}: expected a policy name, got {raw[key]!r}")
    for key in ("samplers", "cfgs"):
        if key in raw and (not isinstance(raw[key], (list, tuple)) or not all(isinstance(n, str) for n in raw[key])):
            raise DeployError(f"policies.{key}: expected a list of policy names, got {raw[key]!r}")
    for key in ("sampler_options", "cfg_options"):
        if key in raw and (not isinstance(raw[key], Mapping) or not all(isinstance(v, Mapping) for v in raw[key].values())):
            raise DeployError(f"policies.{key}: expected {{name: {{option: value}}}}, got {raw[key]!r}")
    return dict(raw)


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    from omniloop_policies import (
        ConstantShift,
        PolicyError,
        PolicyMenu,
        PrecisionPolicy,
        ResolutionShift,
        SchedulerConfigError,
        parse_dtype,
    )
    from omniloop_policies.bundle import DEFAULT_CFGS, DEFAULT_SAMPLERS

    options = options or {}
    comps = model.components
    scheduler = comps["scheduler"]
    sched_config = dict(scheduler.config)
    sched_config.setdefault("_class_name", type(scheduler).__name__)
    source = str(model.path / "scheduler" / "scheduler_config.json") if model.path is not None else "scheduler config"
    deploy = _deploy_policies(options)
    try:
        step_dtype = parse_dtype(deploy.get("step_dtype"), what="policies.step_dtype")
    except PolicyError as err:
        raise DeployError(str(err)) from None
    dtype = comps["transformer"].dtype
    precision = PrecisionPolicy(dtypes={"transformer": dtype}, default_dtype=dtype, step_dtype=step_dtype,
                                latents_dtype=dtype)
    if sched_config.get("use_dynamic_shifting"):
        # diffusers' SD3 pipelines: calculate_shift with these config keys (max_shift default 1.16)
        shift: Any = ResolutionShift.from_config({"max_shift": 1.16, **sched_config})
    else:
        shift = ConstantShift()
    defaults = model.config["defaults"]
    try:
        return PolicyMenu.build(
            sched_config,
            source=source,
            registry=_registry_specs(options),
            samplers=list(dict.fromkeys([*DEFAULT_SAMPLERS, *deploy.get("samplers", ())])),
            cfgs=list(dict.fromkeys([*DEFAULT_CFGS, *deploy.get("cfgs", ())])),
            sampler_options=deploy.get("sampler_options"),
            cfg_options=deploy.get("cfg_options"),
            default_sampler=deploy.get("sampler"),
            default_cfg=deploy.get("cfg", DEFAULT_CFG),
            shift=shift,
            precision=precision,
            default_guidance_scale=float(defaults["guidance_scale"]),
            default_steps=int(defaults["steps"]),
            node=NODE,
        )
    except SchedulerConfigError:
        raise
    except (PolicyError, TypeError, ValueError) as err:
        raise DeployError(f"policies: {err}") from None


def menu_for(model: LoadedModel, task: Any, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu for ``task`` (the default step count differs: 28 t2i, 50 i2i), cached."""
    from omniloop.request import TaskType

    menus = model.config.setdefault(MENU_KEY, {})
    task = TaskType(task)
    menu = menus.get(task)
    if menu is None:
        view = LoadedModel(family=model.family, path=model.path, components=model.components,
                           config={"defaults": model.config["task_defaults"][task]}, device=model.device,
                           dtype=model.dtype)
        menu = build_menu(view, options if options is not None else model.config.get("options"))
        menus[task] = menu
    return menu


__all__ = ["DEFAULT_CFG", "DEPLOY_KEYS", "build_menu", "menu_for"]
