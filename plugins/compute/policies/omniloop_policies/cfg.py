"""Guidance (CFG) policies: which branches to compute at a step, and how to combine them.

A CFG policy is bound when a pipeline is built and holds no per-request data. ``init`` returns the
request's state (kept in ``LoopState.policy_state["cfg"]``); every other method takes it. Per
step the family asks :meth:`CFGPolicy.plan` for the *logical* branches to compute (``"cond"``,
``"uncond"``, ...), computes them, and hands the predictions to :meth:`CFGPolicy.combine`.
:func:`predict_branches` does the middle part: it groups the planned branches into model forwards
(one forward per branch, or one stacked forward when the policy is ``batched``) and runs each
through the bound step interceptors with ``StepContext.branch`` set to the forward's name.

Forward (branch) names: a single branch is named by itself (``"cond"``); a batched group is its
branches joined with ``+`` (``"cond+uncond"``). :meth:`CFGPolicy.branches` lists every forward
name a request may use; the family stores it in ``LoopState.branches`` at init, and per-branch
plugin state is keyed by exactly those names.

Combine formulas reproduce diffusers' pipelines op for op (``uncond + s * (cond - uncond)``, in
the predictions' dtype), so a policy can replace a pipeline's inline CFG bit for bit.

Policies (registered names in brackets): :class:`ClassicCFG` [``classic``; ``batched`` is the
same policy with ``batched=True``], :class:`EmbeddedGuidance` [``embedded``],
:class:`IntervalCFG` [``interval``], :class:`PerModalityCFG` [``per-modality``],
:class:`AdaptiveGateCFG` [``adaptive-gate``], :class:`GuiderCFG` [``guider``] (adapter for
``diffusers.guiders`` objects).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import attrs
import torch
from attrs import define, field

from omniloop.interceptors import call_model
from omniloop.loop import LoopState, StepContext

from .errors import PolicyError

Prediction = torch.Tensor | Mapping[str, torch.Tensor]

COND = "cond"
UNCOND = "uncond"
GROUP_JOIN = "+"


def forward_name(group: Sequence[str]) -> str:
    """The ``StepContext.branch`` of one model forward computing ``group``."""
    return GROUP_JOIN.join(group)


# ============================================================================================
# State and protocol
# ============================================================================================


@define(eq=False)
class CFGState:
    """One request's guidance state (``LoopState.policy_state["cfg"]``)."""

    policy: str
    num_steps: int
    #: the guidance scale of this request
    scale: float
    #: per-expert scales (Wan2.2's ``guidance_scale_2`` for the low-noise expert)
    scales_by_expert: dict[str, float] = attrs.Factory(dict)
    #: False when no step will need the unconditional branch (scale <= 1, as diffusers does)
    enabled: bool = True
    #: steps that computed more than the conditional branch / that reused or skipped it
    full_steps: int = 0
    cond_only_steps: int = 0
    #: the step index last counted in full_steps / cond_only_steps (a step planned twice counts once)
    counted_step: int = -1
    #: policy-private values (cached tensors, per-request guider instance)
    extra: dict[str, Any] = attrs.Factory(dict)

    def scale_for(self, step: StepContext) -> float:
        if step.expert is not None and step.expert in self.scales_by_expert:
            return self.scales_by_expert[step.expert]
        return self.scale


@runtime_checkable
class CFGPolicy(Protocol):
    """What the denoise loop calls. All methods but ``init`` take the request's state."""

    @property
    def name(self) -> str: ...

    @property
    def batched(self) -> bool:
        """Compute multi-branch plans as one stacked forward."""

    @property
    def needs_host_sync(self) -> bool:
        """True when ``plan``/``combine`` read a device value on the host (a sync per step)."""

    def init(
        self, num_steps: int, *, scale: float, scales_by_expert: Mapping[str, float] | None = None
    ) -> CFGState: ...

    def branches(self, state: CFGState) -> tuple[str, ...]: ...

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]: ...

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction: ...

    def model_guidance(self, step: StepContext, state: CFGState) -> float | None: ...

    def metrics(self, state: CFGState) -> dict[str, Any]: ...


def _cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    # The diffusers pipelines' formula and operation order (pipeline_wan.py et al.).
    return uncond + scale * (cond - uncond)


def _rescale(guided: torch.Tensor, cond: torch.Tensor, rescale: float) -> torch.Tensor:
    if rescale <= 0.0:
        return guided
    dims = list(range(1, cond.ndim))
    std_cond = cond.std(dim=dims, keepdim=True)
    std_cfg = guided.std(dim=dims, keepdim=True)
    rescaled = guided * (std_cond / std_cfg)
    return rescale * rescaled + (1 - rescale) * guided


def _check_scale(policy: str, scale: float, what: str = "guidance scale") -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise PolicyError(f"cfg {policy!r}: {what} must be a finite number >= 0, got {scale!r}")
    return float(scale)


@define(frozen=True, kw_only=True)
class _TwoBranchCFG:
    """Shared parts of the cond/uncond policies."""

    name: ClassVar[str] = ""
    needs_host_sync: ClassVar[bool] = False

    batched: bool = False
    #: guidance rescale (Lin et al. 2023; diffusers' ``guidance_rescale``); 0 disables it
    rescale: float = 0.0

    def init(self, num_steps: int, *, scale: float, scales_by_expert: Mapping[str, float] | None = None) -> CFGState:
        if num_steps < 1:
            raise PolicyError(f"cfg {self.name!r}: num_steps must be >= 1, got {num_steps}")
        scale = _check_scale(self.name, scale)
        experts = {
            k: _check_scale(self.name, v, f"scale for expert {k!r}") for k, v in (scales_by_expert or {}).items()
        }
        # diffusers' pipelines decide CFG once per request from the main scale: `guidance_scale > 1`.
        return CFGState(
            policy=self.name, num_steps=num_steps, scale=scale, scales_by_expert=experts, enabled=scale > 1.0
        )

    def possible_plans(self, state: CFGState) -> tuple[tuple[str, ...], ...]:
        return ((COND, UNCOND),) if state.enabled else ((COND,),)

    def branches(self, state: CFGState) -> tuple[str, ...]:
        return _forward_names(self, self.possible_plans(state))

    def model_guidance(self, step: StepContext, state: CFGState) -> float | None:
        return None

    def metrics(self, state: CFGState) -> dict[str, Any]:
        return {"full_steps": state.full_steps, "cond_only_steps": state.cond_only_steps}

    def _count(self, state: CFGState, plan: tuple[str, ...], step: StepContext) -> tuple[str, ...]:
        if state.counted_step == step.step_index:
            return plan  # the same step planned again (a batched forward that raised, re-run alone)
        state.counted_step = step.step_index
        if len(plan) > 1:
            state.full_steps += 1
        else:
            state.cond_only_steps += 1
        return plan

    def _guided(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        cond = preds[COND]
        if UNCOND not in preds:
            return cond
        uncond = preds[UNCOND]
        return _rescale(_cfg(uncond, cond, state.scale_for(step)), cond, self.rescale)  # type: ignore[arg-type]


def _forward_names(policy: Any, plans: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    names: list[str] = []
    for plan in plans:
        for group in forward_groups(policy, plan):
            name = forward_name(group)
            if name not in names:
                names.append(name)
    return tuple(names)


def forward_groups(policy: Any, plan: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """How a plan's branches are computed: one group per model forward."""
    plan = tuple(plan)
    if getattr(policy, "batched", False) and len(plan) > 1:
        return (plan,)
    return tuple((b,) for b in plan)


# ============================================================================================
# Policies
# ============================================================================================


@define(frozen=True, kw_only=True)
class ClassicCFG(_TwoBranchCFG):
    """``uncond + s * (cond - uncond)`` every step. ``batched=True`` stacks cond and uncond in one
    forward (registered as ``batched``); the result equals two forwards up to the model's
    batch-invariance (see the tests for the measured tolerance)."""

    name: ClassVar[str] = "classic"

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        return self._count(state, (COND, UNCOND) if state.enabled else (COND,), step)

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        return self._guided(step, state, preds)


@define(frozen=True, kw_only=True)
class IntervalCFG(_TwoBranchCFG):
    """Guidance only for steps ``i`` with ``int(start * n) <= i < int(end * n)`` (diffusers guiders'
    ``start``/``stop`` rule); one conditional forward outside the window."""

    name: ClassVar[str] = "interval"
    #: the request knobs this policy reads (``DenoiseParams``), applied by :meth:`tune`
    accepts: ClassVar[frozenset[str]] = frozenset({"cfg_window"})

    start: float = 0.0
    end: float = 1.0

    def tune(self, *, cfg_window: tuple[float, float]) -> IntervalCFG:
        return attrs.evolve(self, start=cfg_window[0], end=cfg_window[1])

    def __attrs_post_init__(self) -> None:
        check_window(self.name, self.start, self.end)

    def in_window(self, step: StepContext) -> bool:
        n = step.num_steps
        return bool(int(self.start * n) <= step.step_index < int(self.end * n))

    def possible_plans(self, state: CFGState) -> tuple[tuple[str, ...], ...]:
        return ((COND, UNCOND), (COND,)) if state.enabled else ((COND,),)

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        return self._count(state, (COND, UNCOND) if state.enabled and self.in_window(step) else (COND,), step)

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        return self._guided(step, state, preds)


def check_window(policy: str, start: float, end: float) -> None:
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PolicyError(f"cfg {policy!r}: window bounds must be numbers, got [{start!r}, {end!r})")
    if not (0.0 <= start < end <= 1.0):
        raise PolicyError(
            f"cfg {policy!r}: window [{start}, {end}) must satisfy 0 <= start < end <= 1 (fractions of the steps)"
        )


@define(frozen=True, kw_only=True)
class EmbeddedGuidance:
    """Guidance-distilled models (Flux-style): one forward, the scale passed to the model.

    :meth:`model_guidance` returns ``scale * multiplier`` for the family to pass as the model's
    guidance input; combine is the identity."""

    name: ClassVar[str] = "embedded"
    needs_host_sync: ClassVar[bool] = False
    batched: ClassVar[bool] = False

    multiplier: float = 1.0

    def init(self, num_steps: int, *, scale: float, scales_by_expert: Mapping[str, float] | None = None) -> CFGState:
        scale = _check_scale(self.name, scale)
        experts = {k: _check_scale(self.name, v) for k, v in (scales_by_expert or {}).items()}
        return CFGState(policy=self.name, num_steps=num_steps, scale=scale, scales_by_expert=experts, enabled=False)

    def branches(self, state: CFGState) -> tuple[str, ...]:
        return (COND,)

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        state.cond_only_steps += 1
        return (COND,)

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        return preds[COND]

    def model_guidance(self, step: StepContext, state: CFGState) -> float | None:
        return state.scale_for(step) * self.multiplier

    def metrics(self, state: CFGState) -> dict[str, Any]:
        return {"full_steps": 0, "cond_only_steps": state.cond_only_steps}


def _layout(value: Sequence[tuple[str, int]] | None) -> tuple[tuple[str, int], ...] | None:
    if value is None:
        return None
    out = tuple((str(k), int(n)) for k, n in value)
    if not out or any(n < 1 for _, n in out):
        raise PolicyError(f"cfg 'per-modality': layout needs (name, size >= 1) pairs, got {value!r}")
    return out


@define(frozen=True, kw_only=True)
class PerModalityCFG(_TwoBranchCFG):
    """Classic CFG with one scale per output modality (joint video+audio models).

    A prediction is either a mapping ``{modality: tensor}`` or one tensor whose chunks along
    ``dim`` are the modalities in ``layout`` order (``(("video", 1560), ("audio", 64))``).
    ``scales`` gives per-modality scales; a modality without one uses the request's scale."""

    name: ClassVar[str] = "per-modality"
    #: ``modality_scales`` reaches :meth:`init` (``DenoisePolicies`` passes it); nothing to tune
    accepts: ClassVar[frozenset[str]] = frozenset({"modality_scales"})

    scales: dict[str, float] = field(factory=dict, converter=dict)
    layout: tuple[tuple[str, int], ...] | None = field(default=None, converter=_layout)
    dim: int = 1

    def __attrs_post_init__(self) -> None:
        for k, v in self.scales.items():
            _check_scale(self.name, v, f"scale for modality {k!r}")

    def init(
        self,
        num_steps: int,
        *,
        scale: float,
        scales_by_expert: Mapping[str, float] | None = None,
        modality_scales: Mapping[str, float] | None = None,
    ) -> CFGState:
        state = super().init(num_steps, scale=scale, scales_by_expert=scales_by_expert)
        scales = dict(self.scales)
        for k, v in (modality_scales or {}).items():
            scales[k] = _check_scale(self.name, v, f"scale for modality {k!r}")
        if self.layout is not None:
            unknown = sorted(set(scales) - {k for k, _ in self.layout})
            if unknown:
                raise PolicyError(
                    f"cfg {self.name!r}: no modality {unknown} in the layout {[k for k, _ in self.layout]}"
                )
        state.extra["modality_scales"] = scales
        state.enabled = state.scale > 1.0 or any(v > 1.0 for v in scales.values())
        return state

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        return self._count(state, (COND, UNCOND) if state.enabled else (COND,), step)

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        cond = preds[COND]
        if UNCOND not in preds:
            return cond
        uncond = preds[UNCOND]
        scales: dict[str, float] = state.extra["modality_scales"]
        default = state.scale_for(step)
        if isinstance(cond, Mapping):
            assert isinstance(uncond, Mapping)
            return {k: _rescale(_cfg(uncond[k], cond[k], scales.get(k, default)), cond[k], self.rescale) for k in cond}
        if self.layout is None:
            raise PolicyError(
                f"cfg {self.name!r}: got one tensor per branch but no layout; pass layout=((name, size), ...) "
                "or predictions as {modality: tensor}"
            )
        assert isinstance(cond, torch.Tensor) and isinstance(uncond, torch.Tensor)
        sizes = [n for _, n in self.layout]
        if cond.shape[self.dim] != sum(sizes):
            raise PolicyError(
                f"cfg {self.name!r}: prediction has {cond.shape[self.dim]} entries along dim {self.dim}, "
                f"layout {list(self.layout)} needs {sum(sizes)}"
            )
        chunks = zip(  # noqa: B905 - the splits have the layout's length
            (k for k, _ in self.layout),
            torch.split(cond, sizes, dim=self.dim),
            torch.split(uncond, sizes, dim=self.dim),
        )
        out = [_rescale(_cfg(u, c, scales.get(k, default)), c, self.rescale) for k, c, u in chunks]
        return torch.cat(out, dim=self.dim)


@define(frozen=True, kw_only=True)
class AdaptiveGateCFG(_TwoBranchCFG):
    """Reuse the cached guidance delta ``cond - uncond`` on some steps (one forward instead of two).

    A step computes both branches (a *full* step) when any of these holds, else it computes only
    ``cond`` and returns ``cond + (s - 1) * delta`` with the cached delta:

    * no delta is cached yet, or it was computed by another expert (``StepContext.expert``
      changed: the router switched transformers — the delta of one expert says nothing about
      the other);
    * the step is one of the first ``warmup`` steps, or outside the window ``[start, end)``
      (fractions of the steps; outside it every step is full);
    * ``every`` steps have passed since the last full step;
    * ``threshold`` is set and the relative change ``|delta_k - delta_{k-1}| / |delta_{k-1}|``
      between the last two full steps (same expert) exceeded it: the delta is moving, so keep
      computing it. This reads a norm on the host at full steps (``needs_host_sync``).

    Full steps use the classic formula, so a gate with ``every=1`` equals :class:`ClassicCFG`
    bit for bit. State (the cached delta, the expert it belongs to, counters) is per request.
    """

    name: ClassVar[str] = "adaptive-gate"
    accepts: ClassVar[frozenset[str]] = frozenset({"cfg_window", "gate_every", "gate_threshold"})

    def tune(self, *, cfg_window: tuple[float, float] | None = None, gate_every: int | None = None,
             gate_threshold: float | None = None) -> AdaptiveGateCFG:
        changes: dict[str, Any] = {}
        if cfg_window is not None:
            changes.update(start=cfg_window[0], end=cfg_window[1])
        if gate_every is not None:
            changes["every"] = gate_every
        if gate_threshold is not None:
            changes["threshold"] = gate_threshold
        return attrs.evolve(self, **changes)

    every: int = 2
    threshold: float | None = None
    warmup: int = 1
    start: float = 0.0
    end: float = 1.0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise PolicyError(f"cfg {self.name!r}: every must be an integer >= 1, got {self.every!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise PolicyError(f"cfg {self.name!r}: warmup must be an integer >= 0, got {self.warmup!r}")
        if self.threshold is not None and (not math.isfinite(self.threshold) or self.threshold < 0):
            raise PolicyError(f"cfg {self.name!r}: threshold must be >= 0, got {self.threshold!r}")
        check_window(self.name, self.start, self.end)

    @property
    def needs_host_sync(self) -> bool:  # type: ignore[override]
        return self.threshold is not None

    def possible_plans(self, state: CFGState) -> tuple[tuple[str, ...], ...]:
        return ((COND, UNCOND), (COND,)) if state.enabled else ((COND,),)

    def init(self, num_steps: int, *, scale: float, scales_by_expert: Mapping[str, float] | None = None) -> CFGState:
        state = super().init(num_steps, scale=scale, scales_by_expert=scales_by_expert)
        state.extra.update(delta=None, expert=None, last_full=None, stable=True, invalidations=0)
        return state

    def _must_compute(self, step: StepContext, state: CFGState) -> bool:
        ex = state.extra
        n, i = step.num_steps, step.step_index
        if ex["delta"] is None or i < self.warmup:
            return True
        if ex["expert"] != step.expert:
            return True
        if not (int(self.start * n) <= i < int(self.end * n)):
            return True
        if i - ex["last_full"] >= self.every:
            return True
        return not ex["stable"]

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        if not state.enabled:
            return self._count(state, (COND,), step)
        ex = state.extra
        if ex["delta"] is not None and ex["expert"] != step.expert:
            # the router switched experts: the cached delta belongs to the other transformer
            ex.update(delta=None, expert=None, last_full=None, stable=True)
            ex["invalidations"] += 1
        return self._count(state, (COND, UNCOND) if self._must_compute(step, state) else (COND,), step)

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        cond = preds[COND]
        if not state.enabled:
            return cond
        assert isinstance(cond, torch.Tensor)
        ex = state.extra
        s = state.scale_for(step)
        if UNCOND in preds:
            uncond = preds[UNCOND]
            assert isinstance(uncond, torch.Tensor)
            delta = cond - uncond
            if self.threshold is not None and ex["delta"] is not None and ex["expert"] == step.expert:
                prev = ex["delta"]
                with torch.no_grad():  # a host read of one scalar (needs_host_sync)
                    rel = ((delta.float() - prev.float()).norm() / prev.float().norm().clamp_min(1e-12)).item()
                ex["stable"] = rel <= self.threshold
            else:
                ex["stable"] = self.threshold is None or ex["delta"] is not None
            ex.update(delta=delta, expert=step.expert, last_full=step.step_index)
            return _rescale(_cfg(uncond, cond, s), cond, self.rescale)
        return _rescale(cond + (s - 1.0) * ex["delta"], cond, self.rescale)

    def metrics(self, state: CFGState) -> dict[str, Any]:
        out = super().metrics(state)
        out["invalidations"] = state.extra.get("invalidations", 0)
        return out


# ============================================================================================
# diffusers guider adapter
# ============================================================================================


def _branch_of(prediction_name: str) -> str:
    return prediction_name[len("pred_") :] if prediction_name.startswith("pred_") else prediction_name


@define(frozen=True, kw_only=True)
class GuiderCFG:
    """Adapter for a ``diffusers.guiders`` object (``BaseGuidance`` subclass).

    The guider given at build is a template: each request gets ``guider.new(...)`` (a fresh
    instance, because guiders keep state such as APG's momentum buffer). Branch names are the
    guider's ``_input_predictions`` without the ``pred_`` prefix (``cond``, ``uncond``,
    ``cond_stg``, ...). Guiders that hook the denoiser (``prepare_models`` overridden:
    perturbed-attention, skip-layer, smoothed-energy, auto guidance) would modify shared model
    weights per branch and are refused; a family that can compute such a branch itself should
    use a native policy. The request's scale overrides the guider's ``guidance_scale``.
    """

    name: ClassVar[str] = "guider"
    needs_host_sync: ClassVar[bool] = False

    guider: Any
    batched: bool = False

    def __attrs_post_init__(self) -> None:
        try:
            from diffusers.guiders.guider_utils import BaseGuidance
        except ImportError as err:  # pragma: no cover - diffusers is a dependency
            raise PolicyError(f"cfg 'guider': diffusers guiders are unavailable: {err}") from err
        if not isinstance(self.guider, BaseGuidance):
            raise PolicyError(
                f"cfg 'guider': expected a diffusers BaseGuidance instance, got {type(self.guider).__name__}"
            )
        cls = type(self.guider)
        if (
            cls.prepare_models is not BaseGuidance.prepare_models
            or cls.cleanup_models is not BaseGuidance.cleanup_models
        ):
            raise PolicyError(
                f"cfg 'guider': {cls.__name__} hooks the denoiser (prepare_models) to compute its extra "
                "branches, which would modify the shared transformer per request; it is not supported"
            )

    @property
    def prediction_names(self) -> tuple[str, ...]:
        return tuple(self.guider._input_predictions)

    def init(self, num_steps: int, *, scale: float, scales_by_expert: Mapping[str, float] | None = None) -> CFGState:
        overrides = {}
        if "guidance_scale" in self.guider.config:
            overrides["guidance_scale"] = _check_scale(self.name, scale)
        guider = self.guider.new(**overrides)
        state = CFGState(
            policy=self.name,
            num_steps=num_steps,
            scale=float(scale),
            scales_by_expert=dict(scales_by_expert or {}),
            enabled=True,
        )
        state.extra["guider"] = guider
        return state

    def possible_plans(self, state: CFGState) -> tuple[tuple[str, ...], ...]:
        names = tuple(_branch_of(p) for p in self.prediction_names)
        return tuple(names[:n] for n in range(len(names), 0, -1))

    def branches(self, state: CFGState) -> tuple[str, ...]:
        return _forward_names(self, self.possible_plans(state))

    def plan(self, step: StepContext, state: CFGState) -> tuple[str, ...]:
        guider = state.extra["guider"]
        if "guidance_scale" in guider.config and step.expert in state.scales_by_expert:
            guider.guidance_scale = state.scales_by_expert[step.expert]
        guider.set_state(step.step_index, step.num_steps, torch.tensor(step.timestep))
        n = guider.num_conditions
        plan = tuple(_branch_of(p) for p in self.prediction_names[:n])
        if n > 1:
            state.full_steps += 1
        else:
            state.cond_only_steps += 1
        return plan

    def combine(self, step: StepContext, state: CFGState, preds: Mapping[str, Prediction]) -> Prediction:
        guider = state.extra["guider"]
        kwargs = {p: preds[_branch_of(p)] for p in self.prediction_names if _branch_of(p) in preds}
        return cast(Prediction, guider.forward(**kwargs).pred)

    def model_guidance(self, step: StepContext, state: CFGState) -> float | None:
        return None

    def metrics(self, state: CFGState) -> dict[str, Any]:
        return {"full_steps": state.full_steps, "cond_only_steps": state.cond_only_steps}


# ============================================================================================
# Computing the planned branches
# ============================================================================================

#: ``forward(step) -> prediction`` for one branch (``step.branch`` names it)
Forward = Callable[[StepContext], torch.Tensor]
#: ``forward_batch(step, group) -> prediction stacked along dim 0 in group order``
ForwardBatch = Callable[[StepContext, tuple[str, ...]], torch.Tensor]


def split_batch(stacked: torch.Tensor, group: Sequence[str]) -> dict[str, torch.Tensor]:
    """Split a stacked prediction (dim 0) back into one prediction per branch."""
    if stacked.shape[0] % len(group):
        raise PolicyError(
            f"batched CFG: the stacked prediction has batch {stacked.shape[0]}, not a multiple of {len(group)} branches"
        )
    return dict(zip(group, stacked.chunk(len(group), dim=0), strict=True))


def stack_forward(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    embeds: Mapping[str, torch.Tensor],
) -> ForwardBatch:
    """A ``forward_batch`` for the common case: the branches differ only by their text embeddings.

    ``model(latents_batch, embeds_batch)`` gets ``latents`` repeated once per branch and the
    branches' embeddings concatenated along dim 0 (they must have the same shape)."""

    def forward_batch(step: StepContext, group: tuple[str, ...]) -> torch.Tensor:
        missing = [b for b in group if b not in embeds]
        if missing:
            raise PolicyError(f"batched CFG: no embeddings for branch {missing}; have {sorted(embeds)}")
        shapes = {tuple(embeds[b].shape) for b in group}
        if len(shapes) > 1:
            raise PolicyError(
                "batched CFG needs equal-shape embeddings per branch to stack them; got "
                + ", ".join(f"{b}={tuple(embeds[b].shape)}" for b in group)
            )
        x = torch.cat([latents] * len(group), dim=0)
        e = torch.cat([embeds[b] for b in group], dim=0)
        return model(x, e)

    return forward_batch


def predict_branches(
    cfg: CFGPolicy,
    step: StepContext,
    state: CFGState,
    *,
    forward: Forward,
    forward_batch: ForwardBatch | None = None,
    loop: LoopState | None = None,
    interceptors: Sequence[Any] = (),
    inputs: dict[str, Any] | None = None,
) -> dict[str, Prediction]:
    """Compute the branches ``cfg.plan`` asks for at this step, through the step interceptors.

    Each model forward runs with ``step.with_branch(name)``; a batched group calls
    ``forward_batch`` once and is split. Without ``forward_batch`` a batched policy falls back to
    one forward per branch (same values, more forwards)."""
    plan = cfg.plan(step, state)
    preds: dict[str, Prediction] = {}
    for group in forward_groups(cfg, plan):
        bstep = step.with_branch(forward_name(group))
        if len(group) == 1:
            compute: Callable[[], torch.Tensor] = _bind_forward(forward, bstep)
        elif forward_batch is None:
            for b in group:
                one = step.with_branch(b)
                preds[b] = _run(interceptors, one, loop, inputs, _bind_forward(forward, one))
            continue
        else:
            compute = _bind_batch(forward_batch, bstep, group)
        out = _run(interceptors, bstep, loop, inputs, compute)
        if len(group) == 1:
            preds[group[0]] = out
        else:
            preds.update(split_batch(out, group))
    return preds


def _bind_forward(forward: Forward, step: StepContext) -> Callable[[], torch.Tensor]:
    return lambda: forward(step)


def _bind_batch(forward_batch: ForwardBatch, step: StepContext, group: tuple[str, ...]) -> Callable[[], torch.Tensor]:
    return lambda: forward_batch(step, group)


def _run(
    interceptors: Sequence[Any],
    step: StepContext,
    loop: LoopState | None,
    inputs: dict[str, Any] | None,
    compute: Callable[[], torch.Tensor],
) -> torch.Tensor:
    if not interceptors:
        return compute()
    if loop is None:
        raise PolicyError("predict_branches: step interceptors are bound, so pass loop= (their state lives there)")
    return call_model(interceptors, step, loop, inputs or {}, compute)


def guided_prediction(cfg: CFGPolicy, step: StepContext, state: CFGState, **branches: Any) -> Prediction:
    """``cfg.combine`` of :func:`predict_branches`: the guided prediction for this step.
    ``branches`` are :func:`predict_branches`' keywords (``forward`` required; ``forward_batch``,
    ``loop``, ``interceptors``, ``inputs``)."""
    return cfg.combine(step, state, predict_branches(cfg, step, state, **branches))


CFG_CLASSES: dict[str, type] = {
    ClassicCFG.name: ClassicCFG,
    IntervalCFG.name: IntervalCFG,
    EmbeddedGuidance.name: EmbeddedGuidance,
    PerModalityCFG.name: PerModalityCFG,
    AdaptiveGateCFG.name: AdaptiveGateCFG,
    GuiderCFG.name: GuiderCFG,
}
