"""Entry point ``policies`` (group ``omniloop.plugins``): registers every policy by name.

Registration is cheap and offline: it builds :class:`~omniloop.family.PolicySpec` records whose
factories import diffusers only when called.

Factory calling conventions (by ``kind``):

* ``sampler`` — ``factory(config=scheduler_config_dict, *, source=path, step_dtype=..., strict=False,
  **options)`` → a sampler (``Sampler.from_config``); raises ``SchedulerConfigError`` on an
  incompatible checkpoint config.
* ``cfg`` — ``factory(**options)`` → a CFG policy (``guider`` needs ``guider=<BaseGuidance>``).
* ``shift`` / ``router`` / ``precision`` — ``factory(**options)``.

``params_schema`` of samplers and CFG policies is :class:`~omniloop_policies.params.DenoiseParams`,
the denoise node's request schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omniloop.family import PolicySpec
from omniloop.hookspecs import hookimpl

from .cfg import AdaptiveGateCFG, ClassicCFG, EmbeddedGuidance, GuiderCFG, IntervalCFG, PerModalityCFG
from .params import DenoiseParams
from .precision import PrecisionPolicy
from .routing import BoundaryRouter, SingleExpert
from .samplers import DPMppSampler, FewStepSampler, FlowEulerSampler, UniPCSampler
from .shift import ConstantShift, ResolutionShift

OMNILOOP_HOOK_API = ">=1.0,<2"


def _batched(**options: Any) -> ClassicCFG:
    options.setdefault("batched", True)
    return ClassicCFG(**options)


def _spec(
    name: str, kind: str, factory: Callable[..., Any], description: str, schema: type | None = None
) -> PolicySpec:
    return PolicySpec(name=name, kind=kind, factory=factory, params_schema=schema, description=description)


def builtin_specs() -> list[PolicySpec]:
    """Every policy this package provides, as registry records."""
    P = DenoiseParams
    return [
        _spec(
            "flow-euler",
            "sampler",
            FlowEulerSampler.from_config,
            "flow-matching Euler (FlowMatchEulerDiscreteScheduler)",
            P,
        ),
        _spec("unipc", "sampler", UniPCSampler.from_config, "UniPC multistep, flow prediction + flow sigmas", P),
        _spec("dpmpp", "sampler", DPMppSampler.from_config, "DPM-Solver++ multistep, flow prediction + flow sigmas", P),
        _spec("few-step", "sampler", FewStepSampler.from_config, "fixed distilled timesteps (DMD), x0 + re-noise", P),
        _spec("classic", "cfg", ClassicCFG, "uncond + s * (cond - uncond), two forwards", P),
        _spec("batched", "cfg", _batched, "classic CFG with cond/uncond stacked in one forward", P),
        _spec("embedded", "cfg", EmbeddedGuidance, "guidance-distilled: one forward, scale passed to the model", P),
        _spec("interval", "cfg", IntervalCFG, "guidance only inside [start, end) of the steps", P),
        _spec("per-modality", "cfg", PerModalityCFG, "classic CFG with a scale per output modality", P),
        _spec("adaptive-gate", "cfg", AdaptiveGateCFG, "reuse the cached cond-uncond delta on some steps", P),
        _spec("guider", "cfg", GuiderCFG, "adapter for a diffusers.guiders BaseGuidance object", P),
        _spec("constant", "shift", ConstantShift, "constant flow shift (request > default > checkpoint)"),
        _spec("resolution", "shift", ResolutionShift, "resolution-dependent shift (mu from the token count)"),
        _spec("single", "router", SingleExpert, "one transformer for every step"),
        _spec("boundary", "router", BoundaryRouter, "switch experts at boundary_ratio * num_train_timesteps"),
        _spec("precision", "precision", PrecisionPolicy, "dtypes / autocast per component, step and combine dtype"),
    ]


@hookimpl
def omniloop_register_policies(register: Any) -> None:
    for spec in builtin_specs():
        register(spec)
