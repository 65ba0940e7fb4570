"""Samplers: the solver step of a flow-matching denoise loop.

A sampler is bound once when a pipeline is built (``Sampler.from_config(checkpoint_config)``) and
is immutable afterwards. Everything a request mutates lives in the :class:`SamplerState` that
:meth:`init` returns — including a *fresh* diffusers scheduler instance, because diffusers
schedulers are stateful (step index, multistep history) and must never be shared between
requests. The family keeps that state in ``LoopState.policy_state["sampler"]``.

Provided samplers (registered names in brackets):

* :class:`FlowEulerSampler` [``flow-euler``] — ``FlowMatchEulerDiscreteScheduler``.
* :class:`UniPCSampler` [``unipc``] — ``UniPCMultistepScheduler`` with
  ``prediction_type="flow_prediction"``, ``use_flow_sigmas=True`` (Wan's default).
* :class:`DPMppSampler` [``dpmpp``] — ``DPMSolverMultistepScheduler`` (DPM-Solver++), flow config.
* :class:`FewStepSampler` [``few-step``] — a fixed timestep list for DMD-distilled checkpoints
  (default ``[1000, 757, 522]``): ``x0 = x - sigma * v``, then re-noise to the next sigma with
  fresh noise from the request's generator; the last step returns ``x0``.

Precision: by default the step math runs in float32 (``step_dtype``) and the result is cast back
to the dtype of the sample passed in. ``step_dtype=None`` calls the diffusers scheduler with the
tensors exactly as given, which reproduces a diffusers pipeline bit for bit in any dtype
(including diffusers' own quirks, e.g. ``FlowMatchEulerDiscreteScheduler`` casting its result to
the *model output's* dtype).

Config compatibility (``from_config``): a checkpoint whose scheduler config is incompatible with
a flow sampler is rejected with :class:`~omniloop_policies.errors.SchedulerConfigError` naming the
file and the key, or normalized when the fix is unambiguous (recorded in ``Sampler.notes``); see
:func:`normalize_flow_config` for the rules.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from functools import cache
from typing import Any, ClassVar, cast

import attrs
import torch
from attrs import define, field

from .errors import PolicyError, SchedulerConfigError

FLOW_PREDICTION = "flow_prediction"

#: diffusers scheduler classes whose configs are flow matching by construction (no prediction_type key)
FLOW_MATCH_CLASSES = frozenset(
    {"FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler", "FlowMatchLCMScheduler"}
)
#: sigma rewrites built for VP (epsilon) schedules; with flow sigmas they give NaN or a wrong schedule
VP_SIGMA_REWRITES = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas")
#: keys carried over when a config of one scheduler class feeds a sampler of another class
_SHARED_FLOW_KEYS = frozenset(
    {
        "num_train_timesteps",
        "use_dynamic_shifting",
        "time_shift_type",
        "shift_terminal",
        "invert_sigmas",
        "base_shift",
        "max_shift",
        "base_image_seq_len",
        "max_image_seq_len",
        "stochastic_sampling",
    }
)
_SHARED_MULTISTEP_KEYS = frozenset({"solver_order", "lower_order_final", "final_sigmas_type"})
#: keys that change the sigma schedule: a target that cannot honour them must reject, not drop them
_SCHEDULE_KEYS = ("shift_terminal", "invert_sigmas")
#: keys whose meaning is owned by the sampler (forced to flow values), not taken from options
_OWNED_KEYS = frozenset({"prediction_type", "use_flow_sigmas", "flow_shift", "shift"})


# ============================================================================================
# Per-request state
# ============================================================================================


@define(eq=False)
class SamplerState:
    """One request's sampler state: its own scheduler instance, timesteps and position.

    ``timesteps`` is on the loop's device and is what the model is fed; ``timestep_values`` is a
    host copy taken once at ``init`` so that policies (expert routing, CFG windows) read the
    current timestep without a device sync.
    """

    sampler: str
    num_steps: int
    timesteps: torch.Tensor
    timestep_values: tuple[float, ...]
    #: ``num_steps + 1`` values (the last one is the terminal sigma)
    sigma_values: tuple[float, ...]
    #: a fresh diffusers scheduler owned by this request (None for samplers without one)
    scheduler: Any = None
    #: the request's generator, for samplers that draw noise (few-step, stochastic, SDE)
    generator: torch.Generator | None = None
    #: sampler-private tensors (e.g. the few-step sigmas on the device)
    tensors: dict[str, torch.Tensor] = attrs.Factory(dict)
    #: steps taken so far
    index: int = 0

    @property
    def done(self) -> bool:
        return self.index >= self.num_steps

    def timestep(self, i: int | None = None) -> torch.Tensor:
        """The model's timestep for step ``i`` (default: the next step), on the device."""
        return self.timesteps[self.index if i is None else i]

    def timestep_value(self, i: int | None = None) -> float:
        """The same timestep as a Python float (no device sync)."""
        return self.timestep_values[self.index if i is None else i]


class Sampler:
    """What a denoise loop calls: ``init`` once per request, ``step`` once per solver step. The base
    of every sampler here; a sampler class provides ``_start`` (the state of one request) and
    ``_advance`` (one step's math on the inputs already in ``step_dtype``) and builds itself with
    ``_build`` from :meth:`from_config`."""

    name: ClassVar[str] = ""
    step_dtype: torch.dtype | None

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | None = None,
        *,
        source: str = "scheduler config",
        step_dtype: torch.dtype | None = torch.float32,
        strict: bool = False,
        **options: Any,
    ) -> Any:
        """Build from a checkpoint's scheduler config (``scheduler/scheduler_config.json``).

        Raises :class:`SchedulerConfigError` when the config cannot be run by this sampler;
        ``options`` are the sampler class's own (its ``_build`` keywords)."""
        return cls._build(config, source, step_dtype, strict, **options)

    @classmethod
    def _build(cls, config: Mapping[str, Any] | None, source: str, step_dtype: torch.dtype | None, strict: bool,
               **options: Any) -> Any:
        raise NotImplementedError

    def init(
        self,
        num_steps: int | None,
        *,
        device: torch.device | str = "cpu",
        shift: float | None = None,
        mu: float | None = None,
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> SamplerState:
        """Allocate one request's state (``options``: the sampler class's own, e.g. few-step's
        ``timesteps``)."""
        return self._start(num_steps, device, shift, mu, generator, **options)

    def _start(self, num_steps: int | None, device: torch.device | str, shift: float | None, mu: float | None,
               generator: torch.Generator | None, **options: Any) -> SamplerState:
        raise NotImplementedError

    def timesteps(self, state: SamplerState) -> torch.Tensor:
        return state.timesteps

    def step(
        self, state: SamplerState, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor
    ) -> torch.Tensor:
        """One solver step: the sample at the next timestep, in ``sample``'s dtype (the math in
        ``step_dtype``)."""
        if state.done:
            raise PolicyError(f"sampler {self.name!r}: step called after all {state.num_steps} steps")
        mo, x = _step_inputs(self.step_dtype, model_output, sample)
        out = self._advance(state, mo, timestep, x)
        state.index += 1
        return _step_output(self.step_dtype, out, sample.dtype)

    def _advance(self, state: SamplerState, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor
                 ) -> torch.Tensor:
        raise NotImplementedError


# ============================================================================================
# Config normalization
# ============================================================================================


@cache
def _init_keys(cls: Any) -> frozenset[str]:
    params = inspect.signature(cls.__init__).parameters
    return frozenset(k for k in params if k != "self")


@cache
def _step_takes_generator(cls: Any) -> bool:
    return "generator" in inspect.signature(cls.step).parameters


def _where(source: str, class_name: str | None) -> str:
    return f"{source} ({class_name})" if class_name else source


def _positive_float(value: Any, *, key: str, where: str, sampler: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise SchedulerConfigError(f"{where}: {key}={value!r} is not a number (sampler {sampler!r})") from None
    if not math.isfinite(out) or out <= 0:
        raise SchedulerConfigError(f"{where}: {key}={value!r} must be a finite number > 0 (sampler {sampler!r})")
    return out


@define(frozen=True)
class NormalizedConfig:
    """What :func:`normalize_flow_config` returns: scheduler kwargs plus what it changed."""

    kwargs: dict[str, Any]
    #: normalizations applied (each a sentence naming the file and key); empty when none
    notes: tuple[str, ...] = ()
    #: keys of the source config that the target scheduler class does not use
    ignored: tuple[str, ...] = ()


def normalize_flow_config(
    config: Mapping[str, Any] | None,
    *,
    target: type,
    sampler: str,
    source: str = "scheduler config",
    strict: bool = False,
    options: Mapping[str, Any] | None = None,
) -> NormalizedConfig:
    """Turn a checkpoint's scheduler config into kwargs for ``target``, or raise.

    Rules (each rejection raises :class:`SchedulerConfigError` naming ``source`` and the key):

    * ``prediction_type`` must be ``flow_prediction``; it may be absent only for flow-matching
      classes (``FlowMatch*``) or a config without ``_class_name``. Anything else (``epsilon``,
      ``v_prediction``, ``sample``, or a multistep class without the key, whose default is
      ``epsilon``) is rejected: a flow sampler on such a model decodes noise.
    * ``use_karras_sigmas`` / ``use_exponential_sigmas`` / ``use_beta_sigmas`` /
      ``use_lu_lambdas`` are rejected: they are VP-sigma rewrites and yield NaN or a wrong
      schedule on flow sigmas (the karras-sigmas incident).
    * ``thresholding`` and a learned ``variance_type`` are rejected (pixel-space / DDPM features).
    * ``prediction_type="flow_prediction"`` without ``use_flow_sigmas=True`` is *normalized* to
      flow sigmas (the only meaningful reading; stepping on VP sigmas gives a black video), with a
      note — or rejected when ``strict``.
    * DPM-Solver ``algorithm_type`` ``dpmsolver`` / ``sde-dpmsolver`` (no flow support in
      diffusers) is normalized to the ``++`` variant (or rejected when ``strict``).
    * The shift comes from ``flow_shift`` (UniPC/DPM) or ``shift`` (FlowMatch*), must be > 0.
    * Keys that change the schedule (``shift_terminal``, ``invert_sigmas``) are rejected when the
      target class cannot honour them; other keys of a different class are ignored (listed in
      ``ignored``).
    * ``options`` override config keys; unknown option names raise :class:`PolicyError`.
    """
    cfg = dict(config or {})
    class_name = cfg.get("_class_name")
    where = _where(source, class_name)
    notes: list[str] = []
    keys = _init_keys(target)

    # -- prediction type --------------------------------------------------------------------
    pred = cfg.get("prediction_type")
    if pred is None:
        if class_name is not None and class_name not in FLOW_MATCH_CLASSES:
            raise SchedulerConfigError(
                f"{where}: prediction_type is not set, so {class_name} defaults to 'epsilon'; sampler "
                f"{sampler!r} integrates a flow-matching velocity. Set prediction_type='flow_prediction' "
                "if the model predicts a flow, or use a sampler for epsilon models."
            )
        pred = FLOW_PREDICTION
    if pred != FLOW_PREDICTION:
        raise SchedulerConfigError(
            f"{where}: prediction_type={pred!r}, but sampler {sampler!r} integrates a flow-matching "
            "velocity (prediction_type='flow_prediction'); running it would decode noise (a black or "
            "grey video). Use a sampler for this prediction type."
        )

    # -- schedule rewrites and pixel-space features ------------------------------------------
    for key in VP_SIGMA_REWRITES:
        if cfg.get(key):
            raise SchedulerConfigError(
                f"{where}: {key}=true is a VP-sigma rewrite; on a flow-matching schedule it gives NaN "
                f"or a wrong schedule (sampler {sampler!r}). Set {key}=false."
            )
    if cfg.get("thresholding"):
        raise SchedulerConfigError(
            f"{where}: thresholding=true clips x0 for pixel-space models and corrupts flow latents "
            f"(sampler {sampler!r}). Set thresholding=false."
        )
    if cfg.get("variance_type") not in (None, "fixed_small", "fixed_small_log"):
        raise SchedulerConfigError(
            f"{where}: variance_type={cfg.get('variance_type')!r} (a learned variance) is not a flow model "
            f"(sampler {sampler!r})."
        )

    multistep = "use_flow_sigmas" in keys
    if class_name not in FLOW_MATCH_CLASSES and class_name is not None and not cfg.get("use_flow_sigmas"):
        msg = (
            f"{where}: prediction_type='flow_prediction' without use_flow_sigmas=true; the solver would "
            "step on VP sigmas (a black video)"
        )
        if strict:
            raise SchedulerConfigError(msg + ". Set use_flow_sigmas=true.")
        notes.append(msg + "; normalized to flow sigmas.")

    # -- shift and train timesteps ------------------------------------------------------------
    if class_name in FLOW_MATCH_CLASSES or (class_name is None and "shift" in cfg):
        raw_shift = cfg.get("shift", cfg.get("flow_shift", 1.0))
        shift_key = "shift"
    else:
        raw_shift = cfg.get("flow_shift", cfg.get("shift", 1.0))
        shift_key = "flow_shift"
    shift = _positive_float(raw_shift, key=shift_key, where=where, sampler=sampler)
    ntt = cfg.get("num_train_timesteps", 1000)
    if isinstance(ntt, bool) or not isinstance(ntt, int) or ntt < 1:
        raise SchedulerConfigError(f"{where}: num_train_timesteps={ntt!r} must be an integer >= 1")

    # -- build target kwargs ------------------------------------------------------------------
    same_class = class_name == target.__name__
    if same_class:
        carried = {k: v for k, v in cfg.items() if k in keys and not k.startswith("_")}
    else:
        shared = _SHARED_FLOW_KEYS | (_SHARED_MULTISTEP_KEYS if multistep else frozenset())
        carried = {k: v for k, v in cfg.items() if k in shared and k in keys}
    for key in _SCHEDULE_KEYS:
        if cfg.get(key) and key not in keys:
            raise SchedulerConfigError(
                f"{where}: {key}={cfg[key]!r} changes the sigma schedule, which {target.__name__} "
                f"(sampler {sampler!r}) cannot honour."
            )
    if cfg.get("use_dynamic_shifting") and "use_dynamic_shifting" not in keys:
        raise SchedulerConfigError(
            f"{where}: use_dynamic_shifting=true, which {target.__name__} (sampler {sampler!r}) cannot honour."
        )
    if cfg.get("time_shift_type", "exponential") != "exponential" and "time_shift_type" in keys:
        allowed = inspect.signature(cast(Any, target).__init__).parameters["time_shift_type"].annotation
        if "linear" not in str(allowed):
            raise SchedulerConfigError(
                f"{where}: time_shift_type={cfg['time_shift_type']!r} is not supported by "
                f"{target.__name__} (sampler {sampler!r}); only 'exponential'."
            )
    handled = _OWNED_KEYS | set(VP_SIGMA_REWRITES) | {"thresholding", "variance_type"}
    ignored = tuple(sorted(k for k in cfg if not k.startswith("_") and k not in carried and k not in handled))

    kwargs = dict(carried)
    kwargs["num_train_timesteps"] = ntt
    for key in VP_SIGMA_REWRITES:
        if key in kwargs:
            kwargs[key] = False
    if multistep:
        kwargs.update(prediction_type=FLOW_PREDICTION, use_flow_sigmas=True, flow_shift=shift)
        kwargs.pop("thresholding", None)
        kwargs.pop("variance_type", None)
    else:
        kwargs["shift"] = shift

    for key, value in (options or {}).items():
        if key in _OWNED_KEYS:
            raise PolicyError(
                f"sampler {sampler!r}: option {key!r} is owned by the sampler (flow prediction, flow "
                "sigmas); pass the shift with the 'shift' policy or the request's shift."
            )
        if key not in keys:
            raise PolicyError(
                f"sampler {sampler!r}: unknown option {key!r} for {target.__name__}; known: "
                + ", ".join(sorted(keys - _OWNED_KEYS))
            )
        kwargs[key] = value

    algo = kwargs.get("algorithm_type")
    if algo in ("dpmsolver", "sde-dpmsolver"):
        msg = f"{where}: algorithm_type={algo!r} has no flow-prediction support in diffusers (its step raises)"
        if strict:
            raise SchedulerConfigError(msg + f"; use {algo}++.")
        kwargs["algorithm_type"] = algo + "++"
        notes.append(msg + f"; normalized to {algo + '++'!r} for sampler {sampler!r}.")

    try:
        target(**kwargs)
    except (ValueError, NotImplementedError, TypeError, ImportError) as err:
        raise SchedulerConfigError(
            f"{where}: {target.__name__} rejects the config for sampler {sampler!r}: {err}"
        ) from err
    return NormalizedConfig(kwargs=kwargs, notes=tuple(notes), ignored=ignored)


# ============================================================================================
# Step precision
# ============================================================================================


def _step_inputs(
    step_dtype: torch.dtype | None, model_output: torch.Tensor, sample: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if step_dtype is None:
        return model_output, sample
    return model_output.to(step_dtype), sample.to(step_dtype)


def _step_output(step_dtype: torch.dtype | None, out: torch.Tensor, sample_dtype: torch.dtype) -> torch.Tensor:
    return out if step_dtype is None else out.to(sample_dtype)


# ============================================================================================
# Samplers over diffusers schedulers
# ============================================================================================


def _freeze(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


#: values of :attr:`DiffusersFlowSampler.sigma_schedule`
#: ``sigma_schedule`` values: None (the scheduler's own spacing), ``"linear"`` and ``"sgm_uniform"``
#: (see :attr:`DiffusersFlowSampler.sigma_schedule`)
SIGMA_SCHEDULES = (None, "linear", "sgm_uniform")


def strength_start(num_steps: int, strength: float) -> int:
    """The first step an image-to-image run of ``strength`` takes (diffusers' ``get_timesteps``)."""
    init_timestep = min(num_steps * strength, num_steps)
    return int(max(num_steps - init_timestep, 0))


@define(frozen=True, kw_only=True)
class DiffusersFlowSampler(Sampler):
    """Base of the samplers that run a diffusers scheduler as their math.

    ``config`` holds the normalized scheduler kwargs; each request gets
    ``scheduler_class(**config)`` (with its shift), so no scheduler is ever shared.
    """

    name: ClassVar[str] = ""
    scheduler_class: ClassVar[type]
    #: request knobs this sampler reads: ``strength`` (a partial schedule, :meth:`truncate`)
    accepts: ClassVar[frozenset[str]] = frozenset({"strength"})

    config: dict[str, Any] = field(converter=_freeze)
    step_dtype: torch.dtype | None = torch.float32
    #: normalizations ``from_config`` applied (sentences naming the file and key)
    notes: tuple[str, ...] = ()
    #: source config keys this scheduler class does not use
    ignored: tuple[str, ...] = ()
    source: str = "scheduler config"
    #: the sigmas handed to ``set_timesteps``: None — the scheduler's own spacing; ``"linear"`` —
    #: ``np.linspace(1, 1/n, n)``, what diffusers' Flux pipelines pass (skipped, as there, when the
    #: config sets ``use_flow_sigmas``); ``"sgm_uniform"`` — ``np.linspace(1, σ_min, n + 1)[:-1]``
    #: with ``σ_min`` the shifted last sigma of the training grid, ComfyUI's ``sgm_uniform``
    #: scheduler on a discrete-flow model (the scheduler applies the shift to both, as ComfyUI does)
    sigma_schedule: str | None = field(default=None)

    @sigma_schedule.validator
    def _check_sigma_schedule(self, attribute: Any, value: str | None) -> None:
        if value not in SIGMA_SCHEDULES:
            raise PolicyError(
                f"sampler {self.name!r}: sigma_schedule must be one of {', '.join(map(repr, SIGMA_SCHEDULES))}, "
                f"got {value!r}"
            )
        if value == "sgm_uniform" and self.scheduler_class.__name__ != "FlowMatchEulerDiscreteScheduler":
            raise PolicyError(
                f"sampler {self.name!r}: sigma_schedule='sgm_uniform' needs FlowMatchEulerDiscreteScheduler's "
                f"training-grid sigma_min; {self.scheduler_class.__name__} has none"
            )
        if value is not None and "sigmas" not in inspect.signature(self.scheduler_class.set_timesteps).parameters:
            raise PolicyError(
                f"sampler {self.name!r}: {self.scheduler_class.__name__}.set_timesteps takes no sigmas, so "
                f"sigma_schedule={value!r} cannot apply"
            )

    @classmethod
    def _build(cls, config: Mapping[str, Any] | None, source: str, step_dtype: torch.dtype | None, strict: bool,
               sigma_schedule: str | None = None, **options: Any) -> DiffusersFlowSampler:
        """``options`` override scheduler init arguments (e.g. ``solver_order=3``);
        ``sigma_schedule`` is the sampler's own option (see the attribute)."""
        norm = normalize_flow_config(
            config, target=cls.scheduler_class, sampler=cls.name, source=source, strict=strict, options=options
        )
        return cls(config=norm.kwargs, step_dtype=step_dtype, notes=norm.notes, ignored=norm.ignored, source=source,
                   sigma_schedule=sigma_schedule)

    # -- properties read by other policies ----------------------------------------------------
    @property
    def shift(self) -> float:
        """The checkpoint's shift (``flow_shift`` / ``shift``)."""
        return float(self.config.get("flow_shift", self.config.get("shift", 1.0)))

    @property
    def num_train_timesteps(self) -> int:
        return int(self.config.get("num_train_timesteps", 1000))

    @property
    def dynamic_shifting(self) -> bool:
        return bool(self.config.get("use_dynamic_shifting", False))

    # -- per request ----------------------------------------------------------------------------
    def make_scheduler(self, shift: float | None = None) -> Any:
        """A fresh scheduler instance for one request."""
        kwargs = dict(self.config)
        if shift is not None:
            kwargs["flow_shift" if "flow_shift" in kwargs else "shift"] = float(shift)
        return self.scheduler_class(**kwargs)

    def _start(self, num_steps: int | None, device: torch.device | str, shift: float | None, mu: float | None,
               generator: torch.Generator | None) -> SamplerState:
        """One request's state: a fresh scheduler with ``num_steps`` timesteps.

        ``shift`` overrides the checkpoint's shift. ``mu`` is the resolution-dependent shift
        exponent: passed to ``set_timesteps`` when the config uses dynamic shifting, else turned
        into ``shift = exp(mu)`` (the same exponential time shift, computed through the shift
        formula).
        """
        if num_steps is None or num_steps < 1:
            raise PolicyError(f"sampler {self.name!r}: num_steps must be >= 1, got {num_steps!r}")
        if shift is not None and (not math.isfinite(shift) or shift <= 0):
            raise PolicyError(f"sampler {self.name!r}: shift must be > 0, got {shift!r}")
        set_kwargs: dict[str, Any] = {}
        if self.dynamic_shifting:
            if mu is None:
                raise PolicyError(
                    f"sampler {self.name!r}: the checkpoint uses dynamic (resolution-dependent) shifting; "
                    "bind the 'resolution' shift policy so that init receives mu"
                )
            set_kwargs["mu"] = float(mu)
        elif mu is not None and shift is None:
            shift = math.exp(mu)
        scheduler = self.make_scheduler(shift)
        if self.sigma_schedule == "linear" and not self.config.get("use_flow_sigmas"):
            import numpy as np

            set_kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        elif self.sigma_schedule == "sgm_uniform" and not self.config.get("use_flow_sigmas"):
            import numpy as np

            set_kwargs["sigmas"] = np.linspace(1.0, float(scheduler.sigma_min), num_steps + 1)[:-1]
        scheduler.set_timesteps(num_steps, device=device, **set_kwargs)
        # Diffusers pipelines do this to avoid a device->host sync looking up the step index.
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        return SamplerState(
            sampler=self.name,
            num_steps=len(timesteps),
            timesteps=timesteps,
            timestep_values=tuple(float(t) for t in timesteps.cpu().tolist()),
            sigma_values=tuple(float(s) for s in scheduler.sigmas.cpu().tolist()),
            scheduler=scheduler,
            generator=generator,
        )

    def truncate(self, state: SamplerState, strength: float) -> int:
        """Keep the last ``strength`` of the schedule (image-to-image), as diffusers' img2img
        pipelines' ``get_timesteps`` does: ``t_start = int(n - min(n * strength, n))``, the timesteps
        from ``t_start * order`` on, and the scheduler's begin index there. Call right after
        :meth:`init`, before any step; returns ``t_start``."""
        if state.index:
            raise PolicyError(f"sampler {self.name!r}: truncate after {state.index} step(s); call it before any step")
        t_start = strength_start(state.num_steps, strength)
        if t_start >= state.num_steps:
            raise PolicyError(
                f"sampler {self.name!r}: strength {strength} of {state.num_steps} steps leaves no step to run"
            )
        begin = t_start * int(getattr(state.scheduler, "order", 1))
        state.timesteps = state.timesteps[begin:]
        state.timestep_values = state.timestep_values[begin:]
        state.sigma_values = state.sigma_values[begin:]
        state.num_steps = len(state.timestep_values)
        state.scheduler.set_begin_index(begin)
        return t_start

    def _advance(self, state: SamplerState, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor
                 ) -> torch.Tensor:
        """The diffusers scheduler's step (with the request's generator where it draws noise)."""
        kwargs: dict[str, Any] = {"return_dict": False}
        if state.generator is not None and _step_takes_generator(cast(Hashable, type(state.scheduler))):
            kwargs["generator"] = state.generator
        return state.scheduler.step(model_output, timestep, sample, **kwargs)[0]


def _flow_euler_class() -> type:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler


def _unipc_class() -> type:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler


def _dpm_class() -> type:
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler


class _LazyClass:
    """Resolve the diffusers class on first use, so importing this module (and plugin
    registration) does not import diffusers."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._cls: type | None = None

    def __get__(self, obj: Any, owner: Any) -> type:
        if self._cls is None:
            self._cls = self._loader()
        return self._cls


@define(frozen=True, kw_only=True)
class FlowEulerSampler(DiffusersFlowSampler):
    """Flow-matching Euler (``FlowMatchEulerDiscreteScheduler``)."""

    name: ClassVar[str] = "flow-euler"
    scheduler_class: ClassVar[type] = _LazyClass(_flow_euler_class)  # type: ignore[assignment]


@define(frozen=True, kw_only=True)
class UniPCSampler(DiffusersFlowSampler):
    """UniPC multistep with flow prediction and flow sigmas (``UniPCMultistepScheduler``)."""

    name: ClassVar[str] = "unipc"
    scheduler_class: ClassVar[type] = _LazyClass(_unipc_class)  # type: ignore[assignment]


@define(frozen=True, kw_only=True)
class DPMppSampler(DiffusersFlowSampler):
    """DPM-Solver++ multistep with flow prediction and flow sigmas (``DPMSolverMultistepScheduler``).

    ``algorithm_type="sde-dpmsolver++"`` draws noise from the request's generator."""

    name: ClassVar[str] = "dpmpp"
    scheduler_class: ClassVar[type] = _LazyClass(_dpm_class)  # type: ignore[assignment]


# ============================================================================================
# Few-step (distilled) sampler
# ============================================================================================

#: the 3-step schedule of DMD-distilled Wan (FastWan / FastVideo ``dmd_denoising_steps``)
DMD_WAN_TIMESTEPS = (1000, 757, 522)


def _positive_timesteps(value: Sequence[int | float]) -> tuple[float, ...]:
    out = tuple(float(v) for v in value)
    if not out:
        raise PolicyError("sampler 'few-step': timesteps must not be empty")
    if any(not math.isfinite(t) or t <= 0 for t in out):
        raise PolicyError(f"sampler 'few-step': timesteps must be > 0, got {list(value)}")
    if any(b >= a for a, b in itertools.pairwise(out)):
        raise PolicyError(f"sampler 'few-step': timesteps must be strictly decreasing, got {list(value)}")
    return out


@define(frozen=True, kw_only=True)
class FewStepSampler(Sampler):
    """A fixed timestep list for few-step distilled checkpoints (DMD).

    At step ``i`` with model timestep ``t_i``: ``x0 = x - sigma_i * v``; if a next step exists,
    ``x = (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise`` with fresh noise from the request's
    generator, else the result is ``x0``.

    ``sigma_i`` is looked up on the training grid of ``FlowMatchEulerDiscreteScheduler(
    num_train_timesteps, shift=grid_shift)`` at the grid timestep nearest to ``t_i`` — FastVideo's
    ``DmdDenoisingStage`` (``pred_noise_to_pred_video`` / ``add_noise``, ``shift=8``), which is how
    FastWan checkpoints were distilled. ``warp=True`` instead maps each ``t`` to the grid timestep
    ``grid[num_train_timesteps - t]`` and feeds that to the model (Self-Forcing / CausVid
    ``warp_denoising_step``). The math runs in ``step_dtype`` (float32 by default; FastVideo uses
    float64 for ``x0`` — the difference is below bf16 resolution).
    """

    name: ClassVar[str] = "few-step"
    #: a fixed distilled schedule the request may replace (``timesteps``, passed to :meth:`init`)
    accepts: ClassVar[frozenset[str]] = frozenset({"timesteps"})

    timesteps_list: tuple[float, ...] = field(default=DMD_WAN_TIMESTEPS, converter=_positive_timesteps)
    grid_shift: float = 8.0
    num_train_timesteps: int = 1000
    warp: bool = False
    step_dtype: torch.dtype | None = torch.float32
    notes: tuple[str, ...] = ()
    source: str = "few-step schedule"

    def __attrs_post_init__(self) -> None:
        if not math.isfinite(self.grid_shift) or self.grid_shift <= 0:
            raise PolicyError(f"sampler 'few-step': grid_shift must be > 0, got {self.grid_shift!r}")
        if self.num_train_timesteps < 1:
            raise PolicyError("sampler 'few-step': num_train_timesteps must be >= 1")
        if max(self.timesteps_list) > self.num_train_timesteps:
            raise PolicyError(
                f"sampler 'few-step': timesteps {list(self.timesteps_list)} exceed num_train_timesteps="
                f"{self.num_train_timesteps}"
            )

    @classmethod
    def _build(cls, config: Mapping[str, Any] | None, source: str, step_dtype: torch.dtype | None, strict: bool,
               timesteps: Sequence[int | float] = DMD_WAN_TIMESTEPS, grid_shift: float = 8.0, warp: bool = False,
               ) -> FewStepSampler:
        """Check the checkpoint predicts a flow; the schedule itself comes from the options
        (the distilled timesteps are not in a diffusers scheduler config)."""
        norm = normalize_flow_config(config, target=_flow_euler_class(), sampler=cls.name, source=source, strict=strict)
        return cls(
            timesteps_list=tuple(timesteps),
            grid_shift=float(grid_shift),
            num_train_timesteps=int(norm.kwargs["num_train_timesteps"]),
            warp=warp,
            step_dtype=step_dtype,
            notes=norm.notes,
            source=source,
        )

    @property
    def shift(self) -> float:
        return self.grid_shift

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training grid ``(timesteps, sigmas)`` the sigmas are looked up on (float32, CPU)."""
        sched = _flow_euler_class()(num_train_timesteps=self.num_train_timesteps, shift=self.grid_shift)
        return sched.timesteps.float(), sched.sigmas.float()

    def schedule(self, timesteps: Sequence[float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(model timesteps, sigmas + terminal 0)`` as host floats."""
        ts = self.timesteps_list if timesteps is None else _positive_timesteps(timesteps)
        grid_t, grid_s = self.grid()
        if self.warp:
            full_t = torch.cat([grid_t, torch.zeros(1)])
            full_s = torch.cat([grid_s, torch.zeros(1)])
            rows = [self.num_train_timesteps - round(t) for t in ts]
            return tuple(float(full_t[i]) for i in rows), (*(float(full_s[i]) for i in rows), 0.0)
        query = torch.tensor(ts, dtype=torch.float32)
        idx = torch.argmin((grid_t.unsqueeze(0) - query.unsqueeze(1)).abs(), dim=1)
        return ts, (*(float(s) for s in grid_s[idx].tolist()), 0.0)

    def _start(self, num_steps: int | None, device: torch.device | str, shift: float | None, mu: float | None,
               generator: torch.Generator | None, timesteps: Sequence[float] | None = None) -> SamplerState:
        """The distilled schedule; ``num_steps`` must be None or its length. ``shift``/``mu`` are
        ignored (the schedule is fixed by distillation)."""
        ts, sigmas = self.schedule(timesteps)
        if num_steps is not None and num_steps != len(ts):
            raise PolicyError(
                f"sampler 'few-step' runs exactly its {len(ts)} distilled timesteps {[int(t) for t in ts]}; "
                f"{num_steps} steps were asked"
            )
        t_dtype = torch.float32 if self.warp else torch.int64
        return SamplerState(
            sampler=self.name,
            num_steps=len(ts),
            timesteps=torch.tensor(ts, dtype=t_dtype, device=device),
            timestep_values=ts,
            sigma_values=sigmas,
            generator=generator,
            tensors={"sigmas": torch.tensor(sigmas, dtype=torch.float32, device=device)},
        )

    def _advance(self, state: SamplerState, v: torch.Tensor, timestep: Any, x: torch.Tensor) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        i = state.index
        sigmas = state.tensors["sigmas"]
        x0 = x - sigmas[i] * v
        if i + 1 < state.num_steps:
            noise = randn_tensor(x0.shape, generator=state.generator, device=x0.device, dtype=x0.dtype)
            sigma_next = sigmas[i + 1]
            out = (1.0 - sigma_next) * x0 + sigma_next * noise
        else:
            out = x0
        return out


SAMPLER_CLASSES: dict[str, type] = {
    FlowEulerSampler.name: FlowEulerSampler,
    UniPCSampler.name: UniPCSampler,
    DPMppSampler.name: DPMppSampler,
    FewStepSampler.name: FewStepSampler,
}
