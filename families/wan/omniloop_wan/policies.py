"""The Wan family's denoise policies: one :class:`omniloop_policies.PolicyMenu` per loaded model.

The menu binds what a request of this checkpoint may choose between (samplers built from the
checkpoint's ``scheduler/scheduler_config.json``, CFG policies) plus the expert router (Wan2.2
A14B: ``boundary_ratio`` from ``model_index.json``) and the precision policy. It is built once
per loaded model — at ``load``, so an incompatible scheduler config is a load-time
``CheckpointError`` — and reused by every pipeline and request of that model.

Defaults reproduce diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` bit for bit: the
sampler matching the checkpoint's scheduler class, classic CFG, and the scheduler step on the
tensors as diffusers passes them (``step_dtype=None``: bf16 model output, fp32 latents).

The deploy config may change the node's defaults with ``policies`` (see :data:`DEPLOY_KEYS`)::

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
from omniloop.family import LoadedModel, PolicySpec

#: what ``deploy.policies`` may set
DEPLOY_KEYS = {
    "sampler": "the default sampler (default: the checkpoint's scheduler class)",
    "cfg": "the default CFG policy (default: classic)",
    "samplers": "extra registered sampler names to offer (the built-in four always are)",
    "cfgs": "extra registered CFG policy names to offer",
    "sampler_options": "{sampler: {option: value}} passed to the sampler factories",
    "cfg_options": "{cfg: {option: value}} passed to the CFG policy factories",
    "step_dtype": "dtype of the scheduler step math (default: native, as diffusers; 'float32' upcasts)",
}

MENU_KEY = "policy_menu"
NODE = "denoise"


def _registry_specs(options: Mapping[str, Any]) -> dict[str, PolicySpec]:
    """This package's policies, overridden by what the deployment's registry holds."""
    from omniloop_policies import builtin_specs

    specs = {s.name: s for s in builtin_specs()}
    registry = options.get("registry")
    policies = getattr(registry, "policies", None)
    if isinstance(policies, Mapping):
        specs.update(policies)
    return specs


def _deploy_policies(options: Mapping[str, Any]) -> dict[str, Any]:
    deploy = options.get("deploy")
    raw = getattr(deploy, "policies", None) or {}
    if not isinstance(raw, Mapping):
        raise DeployError(f"policies: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(DEPLOY_KEYS))
    if unknown:
        known = ", ".join(sorted(DEPLOY_KEYS))
        raise DeployError(f"policies.{unknown[0]}: unknown key for the wan family (known: {known})")
    for key in ("sampler", "cfg"):
        if key in raw and not isinstance(raw[key], str):
            raise DeployError(f"policies.{key}: expected a policy name, got {raw[key]!r}")
    for key in ("samplers", "cfgs"):
        if key in raw and (not isinstance(raw[key], (list, tuple)) or not all(isinstance(n, str) for n in raw[key])):
            raise DeployError(f"policies.{key}: expected a list of policy names, got {raw[key]!r}")
    for key in ("sampler_options", "cfg_options"):
        if key in raw and (
            not isinstance(raw[key], Mapping) or not all(isinstance(v, Mapping) for v in raw[key].values())
        ):
            raise DeployError(f"policies.{key}: expected {{name: {{option: value}}}}, got {raw[key]!r}")
    return dict(raw)


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The :class:`~omniloop_policies.PolicyMenu` of ``model`` (not cached; see :func:`menu_for`)."""
    from omniloop_policies import (
        DEFAULT_CFGS,
        DEFAULT_SAMPLERS,
        BoundaryRouter,
        ConstantShift,
        PolicyError,
        PolicyMenu,
        PrecisionPolicy,
        SchedulerConfigError,
        SingleExpert,
        parse_dtype,
    )

    options = options or {}
    cfg = model.config
    comps = model.components
    scheduler = comps["scheduler"]
    sched_config = dict(scheduler.config)
    # a scheduler built in memory has no _class_name in its config: the default sampler is the
    # one matching the instance's class
    sched_config.setdefault("_class_name", type(scheduler).__name__)
    source = str(model.path / "scheduler" / "scheduler_config.json") if model.path is not None else "scheduler config"
    deploy = _deploy_policies(options)
    ntt = int(sched_config.get("num_train_timesteps", 1000))
    router = BoundaryRouter.from_config(cfg.get("model_index") or {}, num_train_timesteps=ntt) or SingleExpert()
    dtypes = {name: comps[name].dtype for name in ("transformer", "transformer_2") if name in comps}
    try:
        step_dtype = parse_dtype(deploy.get("step_dtype"), what="policies.step_dtype")
    except PolicyError as err:
        raise DeployError(str(err)) from None
    precision = PrecisionPolicy(dtypes=dtypes, default_dtype=comps["transformer"].dtype, step_dtype=step_dtype)
    defaults = cfg["defaults"]
    try:
        # a checkpoint's omniloop.json may set its default flow shift (``defaults.shift``); a
        # request's shift wins, and without it the sampler keeps the scheduler config's
        shift = ConstantShift(default=defaults["shift"]) if defaults.get("shift") is not None else None
    except PolicyError as err:
        where = f"{model.path / 'omniloop.json'}: " if model.path is not None else ""
        raise DeployError(f"{where}defaults.shift: {err}") from None
    try:
        return PolicyMenu.build(
            sched_config,
            source=source,
            registry=_registry_specs(options),
            samplers=list(dict.fromkeys([*DEFAULT_SAMPLERS, *deploy.get("samplers", ())])),
            cfgs=list(dict.fromkeys([*DEFAULT_CFGS, *deploy.get("cfgs", ())])),
            # a checkpoint's omniloop.json defaults may name its sampler (a distilled few-step
            # schedule); the deploy's policies win
            sampler_options={**(defaults.get("sampler_options") or {}), **(deploy.get("sampler_options") or {})} or None,
            cfg_options=deploy.get("cfg_options"),
            default_sampler=deploy.get("sampler", defaults.get("sampler")),
            default_cfg=deploy.get("cfg", "classic"),
            router=router,
            shift=shift,
            precision=precision,
            default_guidance_scale=float(defaults["guidance_scale"]),
            default_guidance_scale_2=(
                float(defaults["guidance_scale_2"]) if defaults.get("guidance_scale_2") is not None else None
            ),
            default_steps=int(defaults["steps"]),
            node=NODE,
        )
    except SchedulerConfigError:
        raise  # a CheckpointError naming the file
    except (PolicyError, TypeError, ValueError) as err:
        raise DeployError(f"policies: {err}") from None


def menu_for(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu, built on first use and kept in ``model.config["policy_menu"]``."""
    menu = model.config.get(MENU_KEY)
    if menu is None:
        menu = build_menu(model, options)
        model.config[MENU_KEY] = menu
    return menu


def latent_tokens(shape: tuple[int, ...], patch_size: tuple[int, int, int]) -> int:
    """Tokens the transformer sees for latents of ``shape`` ``[B, C, F, H, W]``."""
    p_t, p_h, p_w = patch_size
    return (shape[2] // p_t) * (shape[3] // p_h) * (shape[4] // p_w)


def describe(model: LoadedModel) -> dict[str, Any]:
    """What the denoise node offers on this model (samplers, CFG policies, defaults)."""
    return dict(menu_for(model).describe())


__all__ = ["DEPLOY_KEYS", "build_menu", "describe", "latent_tokens", "menu_for"]
