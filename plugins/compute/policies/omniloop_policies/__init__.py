"""omniloop-policies: samplers, CFG policies, flow shift, expert routing and precision.

Policies are small strategy objects bound when a pipeline is built; each request's mutable state
lives in ``LoopState.policy_state`` (allocated by ``init``), never on the policy. See README.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): the entry point (omniloop_policies.plugin) registers its specs without importing torch or diffusers (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "bundle": ("DEFAULT_CFGS", "DEFAULT_SAMPLERS", "DenoisePolicies", "PolicyMenu", "sampler_for_config", "strength_steps"),
    "cfg": ("AdaptiveGateCFG", "CFGPolicy", "CFGState", "ClassicCFG", "EmbeddedGuidance", "GuiderCFG", "IntervalCFG", "PerModalityCFG", "forward_groups", "forward_name", "guided_prediction", "predict_branches", "split_batch", "stack_forward"),
    "errors": ("PolicyError", "SchedulerConfigError"),
    "params": ("POLICY_KNOBS", "DenoiseParams", "accepts"),
    "plugin": ("builtin_specs",),
    "precision": ("PrecisionPolicy", "parse_dtype"),
    "rollout": ("gaussian_log_prob", "rollout_step", "step_stats"),
    "routing": ("BoundaryRouter", "ExpertRouter", "SingleExpert"),
    "samplers": ("DMD_WAN_TIMESTEPS", "DPMppSampler", "FewStepSampler", "FlowEulerSampler", "Sampler", "SamplerState", "UniPCSampler", "normalize_flow_config"),
    "shift": ("ConstantShift", "ResolutionShift", "ShiftPolicy", "ShiftValue", "calculate_shift"),
}

if TYPE_CHECKING:
    from .bundle import DEFAULT_CFGS, DEFAULT_SAMPLERS, DenoisePolicies, PolicyMenu, sampler_for_config, strength_steps
    from .cfg import (
        AdaptiveGateCFG,
        CFGPolicy,
        CFGState,
        ClassicCFG,
        EmbeddedGuidance,
        GuiderCFG,
        IntervalCFG,
        PerModalityCFG,
        forward_groups,
        forward_name,
        guided_prediction,
        predict_branches,
        split_batch,
        stack_forward,
    )
    from .errors import PolicyError, SchedulerConfigError
    from .params import POLICY_KNOBS, DenoiseParams, accepts
    from .plugin import builtin_specs
    from .precision import PrecisionPolicy, parse_dtype
    from .rollout import gaussian_log_prob, rollout_step, step_stats
    from .routing import BoundaryRouter, ExpertRouter, SingleExpert
    from .samplers import (
        DMD_WAN_TIMESTEPS,
        DPMppSampler,
        FewStepSampler,
        FlowEulerSampler,
        Sampler,
        SamplerState,
        UniPCSampler,
        normalize_flow_config,
    )
    from .shift import ConstantShift, ResolutionShift, ShiftPolicy, ShiftValue, calculate_shift


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "DEFAULT_CFGS",
    "DEFAULT_SAMPLERS",
    "DMD_WAN_TIMESTEPS",
    "POLICY_KNOBS",
    "AdaptiveGateCFG",
    "BoundaryRouter",
    "CFGPolicy",
    "CFGState",
    "ClassicCFG",
    "ConstantShift",
    "DPMppSampler",
    "DenoiseParams",
    "DenoisePolicies",
    "EmbeddedGuidance",
    "ExpertRouter",
    "FewStepSampler",
    "FlowEulerSampler",
    "GuiderCFG",
    "IntervalCFG",
    "PerModalityCFG",
    "PolicyError",
    "PolicyMenu",
    "PrecisionPolicy",
    "ResolutionShift",
    "Sampler",
    "SamplerState",
    "SchedulerConfigError",
    "ShiftPolicy",
    "ShiftValue",
    "SingleExpert",
    "UniPCSampler",
    "accepts",
    "builtin_specs",
    "calculate_shift",
    "forward_groups",
    "forward_name",
    "gaussian_log_prob",
    "guided_prediction",
    "normalize_flow_config",
    "parse_dtype",
    "predict_branches",
    "rollout_step",
    "sampler_for_config",
    "split_batch",
    "stack_forward",
    "step_stats",
    "strength_steps",
]
