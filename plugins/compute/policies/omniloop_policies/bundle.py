"""Binding policies to a denoise loop: a menu at build, one resolved set per request.

At ``build_pipeline`` a family builds a :class:`PolicyMenu` — the samplers and CFG policies a
request may choose between on this checkpoint (samplers built from the checkpoint's scheduler
config; incompatible ones recorded with the reason), plus the router, shift and precision
policies and the node's defaults. Building the menu is where an incompatible scheduler config
fails loudly (for the default sampler) — never in a step.

Per request, :meth:`PolicyMenu.resolve` validates ``node_params[node]`` and the request's
diffusion knobs and returns the :class:`DenoisePolicies` this request runs with (immutable;
choosing policies is a dict lookup plus the chosen policy's ``tune(**knobs)`` for the knobs it
``accepts``). Its :meth:`init`
allocates the per-request state in ``LoopState.policy_state`` (``"sampler"``, ``"cfg"``) and
declares the guidance branches in ``LoopState.branches``; the other methods are the step
helpers the loop calls. A sketch of a denoise step::

    pol = loop.policy_state["policies"]
    step = pol.step_context(loop, request_id=req.request_id, node=ctx.node.name)
    model = ctx.components[step.expert]
    t = pol.timestep(loop)
    guided = pol.predict(step, loop, forward=lambda s: model(x, t, embeds[s.branch]),
                         interceptors=ctx.step_interceptors)
    x = pol.advance(step, loop, guided, x)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.family import PolicySpec
from omniloop.loop import LoopState, StepContext
from omniloop.schema import check_ranges, structure_params

from .cfg import (
    CFG_CLASSES,
    CFGPolicy,
    CFGState,
    Forward,
    ForwardBatch,
    Prediction,
    predict_branches,
)
from .errors import PolicyError, SchedulerConfigError
from .params import POLICY_KNOBS, DenoiseParams, accepts
from .plugin import builtin_specs
from .precision import PrecisionPolicy
from .rollout import rollout_step
from .routing import ExpertRouter, SingleExpert
from .samplers import SAMPLER_CLASSES, Sampler, SamplerState
from .shift import ConstantShift, ShiftPolicy

SAMPLER_KEY = "sampler"
CFG_KEY = "cfg"
POLICIES_KEY = "policies"


@define(frozen=True, kw_only=True)
class DenoisePolicies:
    """The policies and resolved knobs of one request's denoise loop (immutable)."""

    sampler: Sampler
    cfg: CFGPolicy
    router: ExpertRouter = field(factory=SingleExpert)
    shift: ShiftPolicy = field(factory=ConstantShift)
    precision: PrecisionPolicy = field(factory=PrecisionPolicy)
    #: None: the sampler's own schedule length (few-step) — else the number of steps
    num_steps: int | None = None
    guidance_scale: float = 5.0
    scales_by_expert: dict[str, float] = field(factory=dict)
    #: the request's shift (None: the shift policy decides)
    requested_shift: float | None = None
    #: few-step timesteps override
    timesteps: tuple[int, ...] | None = None
    modality_scales: dict[str, float] | None = None
    #: image-to-image strength (None: the whole schedule); see :func:`strength_steps`
    strength: float | None = None

    # -- init ------------------------------------------------------------------------------------
    def init(
        self,
        loop: LoopState,
        *,
        device: torch.device | str,
        generator: torch.Generator | None = None,
        seq_len: int | None = None,
    ) -> None:
        """Allocate this request's policy state in ``loop`` (call from ``LoopStage.init``).

        Sets ``loop.policy_state["sampler"|"cfg"|"policies"]``, ``loop.branches`` (the forward
        names step interceptors will see) and ``loop.total``. ``seq_len`` (latent tokens) is needed
        by the resolution shift policy; ``generator`` by samplers that draw noise."""
        sv = self.shift.resolve(requested=self.requested_shift, seq_len=seq_len)
        extra: dict[str, Any] = {}
        if self.timesteps is not None:
            if "timesteps" not in accepts(self.sampler):
                raise PolicyError(f"sampler {self.sampler.name!r} has no timesteps option (few-step has)")
            extra["timesteps"] = self.timesteps
        sstate = self.sampler.init(
            self.num_steps, device=device, shift=sv.shift, mu=sv.mu, generator=generator, **extra
        )
        if self.strength is not None:
            truncate = getattr(self.sampler, "truncate", None)
            if truncate is None:
                raise PolicyError(f"sampler {self.sampler.name!r} cannot run a partial schedule (strength)")
            truncate(sstate, self.strength)
        cfg_kw: dict[str, Any] = {"scale": self.guidance_scale, "scales_by_expert": self.scales_by_expert}
        if self.modality_scales is not None:
            cfg_kw["modality_scales"] = self.modality_scales
        cstate = self.cfg.init(sstate.num_steps, **cfg_kw)
        loop.policy_state[SAMPLER_KEY] = sstate
        loop.policy_state[CFG_KEY] = cstate
        loop.policy_state[POLICIES_KEY] = self
        loop.branches = self.cfg.branches(cstate)
        loop.total = sstate.num_steps

    # -- per step -------------------------------------------------------------------------------
    @staticmethod
    def sampler_state(loop: LoopState) -> SamplerState:
        return loop.policy_state[SAMPLER_KEY]  # type: ignore[no-any-return]

    @staticmethod
    def cfg_state(loop: LoopState) -> CFGState:
        return loop.policy_state[CFG_KEY]  # type: ignore[no-any-return]

    def step_context(self, loop: LoopState, *, request_id: str, node: str) -> StepContext:
        """The next step's context: index, host timestep and the router's expert."""
        s = self.sampler_state(loop)
        if s.done:
            raise PolicyError(f"node {node!r}: all {s.num_steps} steps are done")
        t = s.timestep_value()
        return StepContext(
            request_id=request_id,
            node=node,
            step_index=s.index,
            num_steps=s.num_steps,
            timestep=t,
            expert=self.router.active_expert(t),
        )

    def timestep(self, loop: LoopState) -> torch.Tensor:
        """The next step's timestep on the device (what the model is fed)."""
        return self.sampler_state(loop).timestep()

    def model_guidance(self, step: StepContext, loop: LoopState) -> float | None:
        """The guidance value to pass to the model (embedded guidance), else None."""
        return self.cfg.model_guidance(step, self.cfg_state(loop))

    def plan(self, step: StepContext, loop: LoopState) -> tuple[str, ...]:
        """The branches this step computes (call once per step; policies count it)."""
        return self.cfg.plan(step, self.cfg_state(loop))

    def combine(self, step: StepContext, loop: LoopState, preds: Mapping[str, Prediction]) -> Prediction:
        dtype = self.precision.combine_dtype
        if dtype is not None:
            preds = {k: _cast(v, dtype) for k, v in preds.items()}
        return self.cfg.combine(step, self.cfg_state(loop), preds)

    def predict(
        self,
        step: StepContext,
        loop: LoopState,
        *,
        forward: Forward,
        forward_batch: ForwardBatch | None = None,
        interceptors: Sequence[Any] = (),
        inputs: dict[str, Any] | None = None,
    ) -> Prediction:
        """Plan, compute each branch (through ``interceptors``), combine: the guided prediction."""
        preds = predict_branches(self.cfg, step, self.cfg_state(loop), forward=forward, forward_batch=forward_batch,
                                 loop=loop, interceptors=interceptors, inputs=inputs)
        return self.combine(step, loop, preds)

    def advance(self, step: StepContext, loop: LoopState, guided: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The sampler step: latents at the next timestep."""
        s = self.sampler_state(loop)
        if s.index != step.step_index:
            raise PolicyError(
                f"node {step.node!r}: advance for step {step.step_index}, but the sampler is at step {s.index}"
            )
        return self.sampler.step(s, guided, s.timestep(), latents)

    def advance_rollout(
        self, step: StepContext, loop: LoopState, guided: torch.Tensor, latents: torch.Tensor, rollout: Any
    ) -> torch.Tensor:
        """A rollout step (:func:`omniloop_policies.rollout.rollout_step` on the request's
        :class:`omniloop.rl.RolloutRecorder`) instead of the sampler's update:
        the sampler gives the schedule (its sigmas and timesteps), the rollout the step rule."""
        s = self.sampler_state(loop)
        if s.index != step.step_index:
            raise PolicyError(
                f"node {step.node!r}: advance for step {step.step_index}, but the sampler is at step {s.index}"
            )
        if len(s.sigma_values) != s.num_steps + 1:
            raise PolicyError(f"sampler {self.sampler.name!r}: a rollout needs num_steps + 1 sigmas, "
                              f"got {len(s.sigma_values)} for {s.num_steps} steps")
        out = rollout_step(rollout, s.index, guided, latents, s.sigma_values, s.timestep_values)
        s.index += 1
        return out

    def done(self, loop: LoopState) -> bool:
        return self.sampler_state(loop).done

    def metrics(self, loop: LoopState) -> dict[str, Any]:
        out: dict[str, Any] = {"sampler": self.sampler.name, "cfg": self.cfg.name}
        cstate = loop.policy_state.get(CFG_KEY)
        if cstate is not None:
            out.update(self.cfg.metrics(cstate))
        return out


def _cast(value: Prediction, dtype: torch.dtype) -> Prediction:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return {k: v.to(dtype) for k, v in value.items()}


# ============================================================================================
# The menu
# ============================================================================================

DEFAULT_SAMPLERS = ("flow-euler", "unipc", "dpmpp", "few-step")
DEFAULT_CFGS = ("classic", "batched", "interval", "adaptive-gate")


@define(frozen=True, kw_only=True)
class PolicyMenu:
    """What a denoise node offers: policies bound at build, and the node's defaults."""

    samplers: dict[str, Sampler]
    cfgs: dict[str, CFGPolicy]
    router: ExpertRouter = field(factory=SingleExpert)
    shift: ShiftPolicy = field(factory=ConstantShift)
    precision: PrecisionPolicy = field(factory=PrecisionPolicy)
    default_sampler: str
    default_cfg: str = "classic"
    default_guidance_scale: float = 5.0
    default_guidance_scale_2: float | None = None
    default_steps: int = 50
    #: samplers that exist but cannot run this checkpoint, with the reason
    unavailable: dict[str, str] = field(factory=dict)
    node: str = "denoise"

    def __attrs_post_init__(self) -> None:
        if self.default_sampler not in self.samplers:
            why = self.unavailable.get(self.default_sampler)
            if why:
                raise SchedulerConfigError(why)
            raise PolicyError(
                f"node {self.node!r}: default sampler {self.default_sampler!r} is not bound; have {sorted(self.samplers)}"
            )
        if self.default_cfg not in self.cfgs:
            raise PolicyError(
                f"node {self.node!r}: default cfg {self.default_cfg!r} is not bound; have {sorted(self.cfgs)}"
            )

    @classmethod
    def build(
        cls,
        scheduler_config: Mapping[str, Any] | None,
        *,
        source: str = "scheduler config",
        registry: Mapping[str, PolicySpec] | None = None,
        samplers: Iterable[str] = DEFAULT_SAMPLERS,
        cfgs: Iterable[str] = DEFAULT_CFGS,
        sampler_options: Mapping[str, Mapping[str, Any]] | None = None,
        cfg_options: Mapping[str, Mapping[str, Any]] | None = None,
        default_sampler: str | None = None,
        default_cfg: str = "classic",
        router: ExpertRouter | None = None,
        shift: ShiftPolicy | None = None,
        precision: PrecisionPolicy | None = None,
        strict: bool = False,
        **defaults: Any,
    ) -> PolicyMenu:
        """Bind the named policies from ``registry`` (default: this package's) for a checkpoint.

        Each sampler is built with ``spec.factory(config=scheduler_config, source=source,
        step_dtype=precision.step_dtype, strict=strict, **sampler_options[name])``; a sampler the
        config cannot run is recorded in ``unavailable`` — unless it is the default sampler, which
        raises :class:`SchedulerConfigError` (load-time, naming ``source``). The default sampler
        defaults to the one matching the checkpoint's scheduler class (:func:`sampler_for_config`),
        so an untuned request reproduces the diffusers pipeline. CFG policies are built
        with ``spec.factory(**cfg_options[name])``. ``defaults``: ``default_guidance_scale``,
        ``default_guidance_scale_2``, ``default_steps``, ``node``."""
        if default_sampler is None:
            default_sampler = sampler_for_config(scheduler_config)
        if registry is None:
            registry = {s.name: s for s in builtin_specs()}
        precision = precision or PrecisionPolicy()
        sampler_options = sampler_options or {}
        cfg_options = cfg_options or {}
        bound_samplers: dict[str, Sampler] = {}
        unavailable: dict[str, str] = {}
        sampler_names = list(dict.fromkeys([*samplers, default_sampler]))
        for name in sampler_names:
            spec = _spec(registry, name, "sampler")
            try:
                bound_samplers[name] = spec.factory(
                    config=scheduler_config,
                    source=source,
                    step_dtype=precision.step_dtype,
                    strict=strict,
                    **dict(sampler_options.get(name, {})),
                )
            except SchedulerConfigError as err:
                if name == default_sampler:
                    raise
                unavailable[name] = str(err)
        bound_cfgs: dict[str, CFGPolicy] = {}
        for name in dict.fromkeys([*cfgs, default_cfg]):
            spec = _spec(registry, name, "cfg")
            bound_cfgs[name] = spec.factory(**dict(cfg_options.get(name, {})))
        return cls(
            samplers=bound_samplers,
            cfgs=bound_cfgs,
            router=router or SingleExpert(),
            shift=shift or ConstantShift(),
            precision=precision,
            default_sampler=default_sampler,
            default_cfg=default_cfg,
            unavailable=unavailable,
            **defaults,
        )

    # -- request time ---------------------------------------------------------------------------
    def parse(self, data: Mapping[str, Any] | DenoiseParams | None) -> DenoiseParams:
        """``node_params[node]`` validated for this node: the core's converter for types and ranges
        (already done when ``data`` comes from ``Runtime.prepare``), then the node's own rules —
        known policy names, knobs the chosen policies accept. Raises ``RequestError`` with the
        dotted path and the node's name."""
        path = f"node_params.{self.node}"
        try:
            if isinstance(data, DenoiseParams):
                check_ranges(data, path)
                p = data
            elif data is None or isinstance(data, Mapping):
                p = structure_params(DenoiseParams, data, path)
            else:
                raise RequestError(path, f"params must be an object, got {type(data).__name__}")
        except RequestError as err:
            raise RequestError(err.path, f"node {self.node!r}: {err.message}") from None
        self._check_names(p, path)
        return p

    def _check_names(self, p: DenoiseParams, path: str) -> None:
        def err(key: str, msg: str) -> RequestError:
            return RequestError(f"{path}.{key}", f"node {self.node!r}: {msg}")

        chosen: dict[str, Any] = {}
        for role, table in (("sampler", self.samplers), ("cfg", self.cfgs)):
            name = getattr(p, role)
            if name is not None:
                if name in self.unavailable:
                    raise err(role, f"{role} {name!r} cannot run on this model: {self.unavailable[name]}")
                if name not in table:
                    raise err(role, f"unknown {role} {name!r}; available: {', '.join(sorted(table))}")
            default = self.default_sampler if role == "sampler" else self.default_cfg
            chosen[role] = (name or default, table[name or default])
        for knob, role in POLICY_KNOBS.items():
            if getattr(p, knob) is None:
                continue
            name, policy = chosen[role]
            if knob in accepts(policy):
                continue
            table = self.samplers if role == "sampler" else self.cfgs
            owners = sorted(n for n, pol in table.items() if knob in accepts(pol))
            if not owners:  # none bound here: name the known policies that read it
                known = SAMPLER_CLASSES if role == "sampler" else CFG_CLASSES
                owners = sorted(n for n, cls in known.items() if knob in accepts(cls))
            readers = " / ".join(owners) or "no bound"
            fix = f"set {role}={owners[0]!r} or drop {knob}" if owners else f"drop {knob}"
            raise err(knob, f"{knob} is read by the {readers} {role} policy, but this request uses {role} {name!r}; {fix}")

    def resolve(self, request: Any = None, params: Mapping[str, Any] | DenoiseParams | None = None) -> DenoisePolicies:
        """The policies for one request: ``node_params`` > ``request.diffusion`` > node defaults.

        ``params`` defaults to ``request.node_params.get(node)``. Raises ``RequestError``."""
        if params is None and request is not None:
            params = (getattr(request, "node_params", None) or {}).get(self.node)
        p = self.parse(params)
        diffusion = getattr(request, "diffusion", None)
        path = f"node_params.{self.node}"

        sampler_name = p.sampler or self.default_sampler
        sampler = self.samplers[sampler_name]
        cfg_name = p.cfg or self.default_cfg
        cfg = self.cfgs[cfg_name]
        cfg = _tune(cfg, p, path, self.node)

        requested_scale = _first(p.guidance_scale, getattr(diffusion, "guidance_scale", None))
        scale = _first(requested_scale, self.default_guidance_scale)
        scales_by_expert: dict[str, float] = {}
        experts = tuple(self.router.experts)
        if len(experts) >= 2:
            # diffusers' WanPipeline: guidance_scale_2 defaults to guidance_scale; a model default for
            # the second expert applies only when the request did not set a scale itself.
            scale_2 = _first(
                p.guidance_scale_2,
                requested_scale,
                self.default_guidance_scale_2,
                scale,
            )
            scales_by_expert[experts[1]] = float(scale_2)
        elif p.guidance_scale_2 is not None:
            raise RequestError(
                f"{path}.guidance_scale_2",
                f"node {self.node!r}: guidance_scale_2 applies to the second expert, but router "
                f"{self.router.name!r} has one ({experts[0]!r})",
            )
        shift = _first(p.shift, getattr(diffusion, "shift", None))

        steps_from_request = p.steps is not None
        steps = _first(p.steps, getattr(diffusion, "steps", None))
        if "timesteps" in accepts(sampler):  # a fixed, distilled schedule (few-step)
            n = len(p.timesteps) if p.timesteps is not None else len(sampler.timesteps_list)  # type: ignore[attr-defined]
            if steps is not None and steps != n:
                where = f"{path}.steps" if steps_from_request else "diffusion.steps"
                raise RequestError(
                    where,
                    f"node {self.node!r}: sampler 'few-step' runs exactly its {n} distilled timesteps; "
                    f"steps={steps} was asked (omit steps, or choose another sampler)",
                )
            num_steps: int | None = None
        else:
            num_steps = steps if steps is not None else self.default_steps
        if p.strength is not None and num_steps is not None and strength_steps(num_steps, p.strength) < 1:
            raise RequestError(
                f"{path}.strength",
                f"node {self.node!r}: strength {p.strength} of {num_steps} steps leaves no step to run; "
                "raise strength or steps",
            )

        return DenoisePolicies(
            sampler=sampler,
            cfg=cfg,
            router=self.router,
            shift=self.shift,
            precision=self.precision,
            num_steps=num_steps,
            guidance_scale=float(scale),
            scales_by_expert=scales_by_expert,
            requested_shift=shift,
            timesteps=p.timesteps,
            modality_scales=p.modality_scales,
            strength=p.strength,
        )

    def describe(self) -> dict[str, Any]:
        """What this node offers (for ``omniloop describe`` / docs)."""
        return {
            "node": self.node,
            "samplers": sorted(self.samplers),
            "unavailable_samplers": dict(self.unavailable),
            "cfgs": sorted(self.cfgs),
            "router": self.router.name,
            "experts": list(self.router.experts),
            "shift": self.shift.name,
            "defaults": {
                "sampler": self.default_sampler,
                "cfg": self.default_cfg,
                "guidance_scale": self.default_guidance_scale,
                "guidance_scale_2": self.default_guidance_scale_2,
                "steps": self.default_steps,
            },
            "notes": {k: list(getattr(v, "notes", ())) for k, v in self.samplers.items() if getattr(v, "notes", ())},
        }


#: diffusers scheduler class -> the sampler that reproduces it
SAMPLER_FOR_CLASS = {
    "FlowMatchEulerDiscreteScheduler": "flow-euler",
    "UniPCMultistepScheduler": "unipc",
    "DPMSolverMultistepScheduler": "dpmpp",
}


def sampler_for_config(config: Mapping[str, Any] | None) -> str:
    """The sampler matching a checkpoint's scheduler class (``flow-euler`` when unknown/absent)."""
    return SAMPLER_FOR_CLASS.get(str((config or {}).get("_class_name")), "flow-euler")


def strength_steps(num_steps: int, strength: float) -> int:
    """Steps an image-to-image run of ``strength`` takes out of ``num_steps`` (diffusers' ``get_timesteps``)."""
    from .samplers import strength_start

    return num_steps - strength_start(num_steps, strength)


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _spec(registry: Mapping[str, PolicySpec], name: str, kind: str) -> PolicySpec:
    spec = registry.get(name)
    if spec is None or spec.kind != kind:
        have = sorted(n for n, s in registry.items() if s.kind == kind)
        raise PolicyError(f"no {kind} policy named {name!r} is registered; registered: {', '.join(have)}")
    return spec


def _tune(policy: Any, p: DenoiseParams, path: str, node: str) -> Any:
    """``policy.tune(**knobs)`` with the knobs it accepts that the request set (a tuned copy)."""
    knobs = {k: getattr(p, k) for k in accepts(policy) if k in POLICY_KNOBS and getattr(p, k) is not None}
    tune = getattr(policy, "tune", None)
    if not knobs or not callable(tune):
        return policy
    try:
        return tune(**knobs)
    except PolicyError as err:
        raise RequestError(path, f"node {node!r}: {err}") from err
