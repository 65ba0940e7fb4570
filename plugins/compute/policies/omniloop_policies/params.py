"""The denoise node's parameter schema: the policy knobs a request may set.

A request sets them under ``node_params.<node>`` (usually ``denoise``)::

    {"node_params": {"denoise": {"sampler": "unipc", "guidance_scale": 4.0, "cfg_window": [0.1, 0.8]}}}

:class:`DenoiseParams` is validated by the core's one cattrs converter
(``omniloop.schema.structure_params``): ranges live in the field metadata (``ge``/``gt``/``le``),
shapes in attrs validators, and every error names the dotted path
(``node_params.denoise.cfg_window``). Nothing here re-checks a range by hand.

What needs the node (is ``sampler`` one of its samplers? does the chosen policy read
``cfg_window``?) is checked by :meth:`omniloop_policies.PolicyMenu.resolve`. Policy-specific knobs
(:data:`POLICY_KNOBS`) are read only by the policies that declare them in their ``accepts``
attribute (e.g. ``IntervalCFG.accepts = {"cfg_window"}``); a knob the request's policy does not
accept is refused, so a typo'd setup never silently does nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

from attrs import define, field


def _c(**constraints: Any) -> dict[str, Any]:
    return dict(constraints)


# shape rules, applied by the core's converter (``check`` field metadata) with the field's path
def _window(value: tuple[float, ...]) -> str | None:
    if len(value) != 2 or not 0.0 <= value[0] < value[1] <= 1.0:
        return f"cfg_window must be [start, end) with 0 <= start < end <= 1, got {list(value)!r}"
    return None


def _decreasing(value: tuple[int, ...]) -> str | None:
    if not value or any(t <= 0 for t in value) or any(b >= a for a, b in itertools.pairwise(value)):
        return f"timesteps must be a strictly decreasing list of positive integers, got {list(value)!r}"
    return None


def _scales(value: dict[str, float]) -> str | None:
    if any(v < 0 for v in value.values()):
        return f"modality_scales must map modality names to numbers >= 0, got {value!r}"
    return None


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@define(frozen=True, kw_only=True)
class DenoiseParams:
    """Per-request knobs of a denoise loop. ``None`` means the node's default."""

    #: sampler name (``flow-euler``, ``unipc``, ``dpmpp``, ``few-step``)
    sampler: str | None = None
    #: CFG policy name (``classic``, ``batched``, ``interval``, ``adaptive-gate``, ...)
    cfg: str | None = None
    guidance_scale: float | None = field(default=None, metadata=_c(ge=0.0))
    #: scale while the second (low-noise) expert runs — Wan2.2's ``guidance_scale_2``
    guidance_scale_2: float | None = field(default=None, metadata=_c(ge=0.0))
    shift: float | None = field(default=None, metadata=_c(gt=0.0))
    steps: int | None = field(default=None, metadata=_c(ge=1))
    #: guidance window ``[start, end)`` as fractions of the steps
    cfg_window: tuple[float, ...] | None = field(default=None, converter=_tuple, metadata=_c(check=_window))
    #: adaptive gate: recompute the guidance delta at least every N steps
    gate_every: int | None = field(default=None, metadata=_c(ge=1))
    #: adaptive gate: recompute while the delta changes by more than this (relative)
    gate_threshold: float | None = field(default=None, metadata=_c(ge=0.0))
    #: few-step sampler: the distilled timesteps (strictly decreasing)
    timesteps: tuple[int, ...] | None = field(default=None, converter=_tuple, metadata=_c(check=_decreasing))
    #: per-modality CFG: scale per output modality
    modality_scales: dict[str, float] | None = field(default=None, metadata=_c(check=_scales))
    #: image-to-image: the fraction of the schedule run, from the input noised to its first
    #: timestep (diffusers' img2img ``strength``; 1.0 runs every step). Families say which tasks take it.
    strength: float | None = field(default=None, metadata=_c(gt=0.0, le=1.0))


#: knobs only some policies read, and the policy role ("sampler" or "cfg") that reads them; a
#: policy reads a knob when its ``accepts`` names it
POLICY_KNOBS: dict[str, str] = {
    "cfg_window": "cfg",
    "gate_every": "cfg",
    "gate_threshold": "cfg",
    "modality_scales": "cfg",
    "timesteps": "sampler",
    "strength": "sampler",
}


def accepts(policy: Any) -> frozenset[str]:
    """The policy-specific knobs ``policy`` declares it reads (none when it declares nothing)."""
    return frozenset(getattr(policy, "accepts", ()) or ())


__all__ = ["POLICY_KNOBS", "DenoiseParams", "accepts"]
