"""The denoise node's policy menu of a diffusers-format family, built from the deploy's ``policies:``.

``policies:`` is validated by a schema class (:class:`DeployPolicies`, the one cattrs converter:
an unknown key, a wrong type or a non-finite number is one :class:`DeployError` naming
``policies.<key>``); a family names the keys it takes (FLUX takes none: its sampler is fixed, so
an entry is refused, never ignored). :func:`build_menu` then builds the
:class:`omniloop_policies.PolicyMenu` from the scheduler's config, the registry's policies, the
deploy's choices and the family's own policies (shift, router, precision, defaults);
:func:`cached_menu` keeps it on the loaded model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define

from omniloop.errors import DeployError, RequestError
from omniloop.family import LoadedModel, PolicySpec
from omniloop.schema import structure_params

#: every key of the deploy's ``policies:`` block
DEPLOY_KEYS = ("sampler", "cfg", "samplers", "cfgs", "sampler_options", "cfg_options", "step_dtype")
MENU_KEY = "policy_menu"
NODE = "denoise"


@define(frozen=True)
class DeployPolicies:
    """The deploy's ``policies:`` block: the node's default ``sampler`` and ``cfg`` policy, more
    ``samplers``/``cfgs`` to offer, options per policy name, and the scheduler step's dtype."""

    sampler: str | None = None
    cfg: str | None = None
    samplers: tuple[str, ...] = ()
    cfgs: tuple[str, ...] = ()
    sampler_options: dict[str, dict[str, Any]] | None = None
    cfg_options: dict[str, dict[str, Any]] | None = None
    step_dtype: str | None = None


def deploy_policies(options: Mapping[str, Any], family: str, keys: Sequence[str] = DEPLOY_KEYS) -> DeployPolicies:
    """The deploy's ``policies:`` validated (``options["deploy"]``; none: the defaults). A key the
    family does not take is refused, naming the family."""
    deploy = options.get("deploy")
    raw = deploy.policies if deploy is not None else {}
    if not isinstance(raw, Mapping):
        raise DeployError(f"policies: expected a mapping, got {type(raw).__name__}")
    untaken = [k for k in raw if k in DEPLOY_KEYS and k not in keys]
    if untaken:
        takes = ", ".join(keys) or "none"
        raise DeployError(f"policies.{untaken[0]}: family {family!r} does not take this deploy policy (it takes: {takes})")
    for key in ("samplers", "cfgs"):  # the converter would read a string as a sequence of letters
        if isinstance(raw.get(key), str):
            raise DeployError(f"policies.{key}: expected a list of policy names, got {raw[key]!r}")
    try:
        return structure_params(DeployPolicies, raw, "policies")
    except RequestError as exc:
        raise DeployError(str(exc)) from None


def registry_specs(options: Mapping[str, Any]) -> dict[str, PolicySpec]:
    """omniloop-policies' built-in policies, overridden by what the deployment's registry holds."""
    from omniloop_policies import builtin_specs

    specs = {s.name: s for s in builtin_specs()}
    registry = options.get("registry")
    if registry is not None:
        specs.update(registry.policies)
    return specs


def step_dtype(deploy: DeployPolicies) -> Any:
    """``policies.step_dtype`` as a torch dtype (None: the tensors' own)."""
    from omniloop_policies import PolicyError, parse_dtype

    try:
        return parse_dtype(deploy.step_dtype, what="policies.step_dtype")
    except PolicyError as err:
        raise DeployError(str(err)) from None


def build_menu(model: LoadedModel, options: Mapping[str, Any], deploy: DeployPolicies, *,
               samplers: Sequence[str] | None = None, cfgs: Sequence[str] | None = None,
               sampler_options: Mapping[str, Any] | None = None, default_sampler: str | None = None,
               default_cfg: str, **policies: Any) -> Any:
    """The model's :class:`~omniloop_policies.PolicyMenu` (not cached): the scheduler config of
    ``model.components["scheduler"]`` (its class names the default sampler), the registry's
    policies, ``samplers``/``cfgs`` (default: omniloop-policies' defaults) plus the deploy's, the
    family's ``sampler_options`` under the deploy's, the deploy's default sampler/CFG over the
    family's, and ``policies`` (``shift``, ``router``, ``precision``, ``default_steps``,
    ``default_guidance_scale``, ...) as they are; ``default_steps`` and ``default_guidance_scale``
    default to the model's ``config["defaults"]`` (``steps``, ``guidance_scale``). A bad choice is
    one :class:`DeployError`."""
    from omniloop_policies import DEFAULT_CFGS, DEFAULT_SAMPLERS, PolicyError, PolicyMenu, SchedulerConfigError

    defaults = model.config.get("defaults") or {}
    if "steps" in defaults:
        policies.setdefault("default_steps", int(defaults["steps"]))
    if "guidance_scale" in defaults:
        policies.setdefault("default_guidance_scale", float(defaults["guidance_scale"]))

    scheduler = model.components["scheduler"]
    sched_config = dict(scheduler.config)
    # a scheduler built in memory has no _class_name in its config: the default sampler is the
    # one matching the instance's class
    sched_config.setdefault("_class_name", type(scheduler).__name__)
    source = str(model.path / "scheduler" / "scheduler_config.json") if model.path is not None else "scheduler config"
    merged_options = {**(sampler_options or {}), **(deploy.sampler_options or {})} or None
    try:
        return PolicyMenu.build(
            sched_config, source=source, registry=registry_specs(options),
            samplers=list(dict.fromkeys([*(DEFAULT_SAMPLERS if samplers is None else samplers), *deploy.samplers])),
            cfgs=list(dict.fromkeys([*(DEFAULT_CFGS if cfgs is None else cfgs), *deploy.cfgs])),
            sampler_options=merged_options, cfg_options=deploy.cfg_options,
            default_sampler=deploy.sampler or default_sampler, default_cfg=deploy.cfg or default_cfg,
            node=NODE, **policies,
        )
    except SchedulerConfigError:
        raise  # a CheckpointError naming the file
    except (PolicyError, TypeError, ValueError) as err:
        raise DeployError(f"policies: {err}") from None


def scheduler_shift(model: LoadedModel, dynamic: Mapping[str, Any] | None = None) -> Any:
    """The shift policy the checkpoint's scheduler config asks for: ``resolution`` (``mu`` from the
    latent token count; ``dynamic``: config defaults under the file's) when it sets
    ``use_dynamic_shifting``, else ``constant`` (the config's static shift)."""
    from omniloop_policies import ConstantShift, ResolutionShift

    config = dict(model.components["scheduler"].config)
    if config.get("use_dynamic_shifting"):
        return ResolutionShift.from_config({**(dynamic or {}), **config})
    return ConstantShift()


def model_precision(model: LoadedModel, deploy: DeployPolicies | None = None, *, latents: bool = False) -> Any:
    """The precision policy of a one-transformer model: the transformer's dtype, the deploy's
    ``policies.step_dtype`` (None: the tensors' own), and — ``latents`` — latents kept in that dtype
    between steps (as diffusers keeps SD3's)."""
    from omniloop_policies import PrecisionPolicy

    dtype = model.components["transformer"].dtype
    extra = {"latents_dtype": dtype} if latents else {}
    return PrecisionPolicy(dtypes={"transformer": dtype}, default_dtype=dtype,
                           step_dtype=step_dtype(deploy) if deploy is not None else None, **extra)


def cached_menu(model: LoadedModel, build: Callable[[], Any], key: Any = None) -> Any:
    """``build()``'s menu, built on first use and kept in ``model.config["policy_menu"]`` (under
    ``key`` when a model keeps one per task)."""
    if key is None:
        menu = model.config.get(MENU_KEY)
        if menu is None:
            menu = model.config[MENU_KEY] = build()
        return menu
    menus = model.config.setdefault(MENU_KEY, {})
    if key not in menus:
        menus[key] = build()
    return menus[key]


__all__ = ["DEPLOY_KEYS", "MENU_KEY", "NODE", "DeployPolicies", "build_menu", "cached_menu", "deploy_policies",
           "model_precision", "registry_specs", "scheduler_shift", "step_dtype"]
