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

import importlib
from collections.abc import Callable
from typing import Any

from omniloop.family import PolicySpec
from omniloop.hookspecs import hookimpl

from .params import DenoiseParams

OMNILOOP_HOOK_API = ">=1.0,<2"


def _lazy(module: str, name: str, method: str | None = None) -> Callable[..., Any]:
    """A factory that imports ``omniloop_policies.<module>.<name>`` (torch, diffusers) when called:
    registering the policies imports neither (issue 42: ``omniloop --help`` imports no torch)."""

    def factory(*args: Any, **kwargs: Any) -> Any:
        obj = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return (getattr(obj, method) if method else obj)(*args, **kwargs)

    factory.__qualname__ = factory.__name__ = f"{name}.{method}" if method else name
    return factory


def _batched(**options: Any) -> Any:
    from .cfg import ClassicCFG

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
            _lazy("samplers", "FlowEulerSampler", "from_config"),
            "flow-matching Euler (FlowMatchEulerDiscreteScheduler)",
            P,
        ),
        _spec("unipc", "sampler", _lazy("samplers", "UniPCSampler", "from_config"), "UniPC multistep, flow prediction + flow sigmas", P),
        _spec("dpmpp", "sampler", _lazy("samplers", "DPMppSampler", "from_config"), "DPM-Solver++ multistep, flow prediction + flow sigmas", P),
        _spec("few-step", "sampler", _lazy("samplers", "FewStepSampler", "from_config"), "fixed distilled timesteps (DMD), x0 + re-noise", P),
        _spec("classic", "cfg", _lazy("cfg", "ClassicCFG"), "uncond + s * (cond - uncond), two forwards", P),
        _spec("batched", "cfg", _batched, "classic CFG with cond/uncond stacked in one forward", P),
        _spec("embedded", "cfg", _lazy("cfg", "EmbeddedGuidance"), "guidance-distilled: one forward, scale passed to the model", P),
        _spec("interval", "cfg", _lazy("cfg", "IntervalCFG"), "guidance only inside [start, end) of the steps", P),
        _spec("per-modality", "cfg", _lazy("cfg", "PerModalityCFG"), "classic CFG with a scale per output modality", P),
        _spec("adaptive-gate", "cfg", _lazy("cfg", "AdaptiveGateCFG"), "reuse the cached cond-uncond delta on some steps", P),
        _spec("guider", "cfg", _lazy("cfg", "GuiderCFG"), "adapter for a diffusers.guiders BaseGuidance object", P),
        _spec("constant", "shift", _lazy("shift", "ConstantShift"), "constant flow shift (request > default > checkpoint)"),
        _spec("resolution", "shift", _lazy("shift", "ResolutionShift"), "resolution-dependent shift (mu from the token count)"),
        _spec("single", "router", _lazy("routing", "SingleExpert"), "one transformer for every step"),
        _spec("boundary", "router", _lazy("routing", "BoundaryRouter"), "switch experts at boundary_ratio * num_train_timesteps"),
        _spec("precision", "precision", _lazy("precision", "PrecisionPolicy"), "dtypes / autocast per component, step and combine dtype"),
    ]


@hookimpl
def omniloop_register_policies(register: Any) -> None:
    for spec in builtin_specs():
        register(spec)
