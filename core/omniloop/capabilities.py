"""What a family declares it can do: :class:`FamilyCapabilities`, the family contract's optional part.

A family object (:class:`omniloop.family.Family`) has the required protocol methods (``detect``,
``load``, ``build_pipeline``, ``validate_request``), a ``name``, its ``tasks`` and one
``capabilities`` attribute holding a frozen :class:`FamilyCapabilities`. Everything else the core or
a plugin may ask of a family is a field there; nobody looks for optional attributes on the family
object (``tests/core/test_family_contract.py`` walks the source and fails on such a probe).

The declaration is checked when the family registers (:func:`validate`): a family that declares
something it cannot serve (an optional method it does not define, ``sp`` parallelism without a way
to count attention heads, an unknown parallel axis, ...) fails registration with one line naming
the field. Fields, each defaulting to "not supported":

``block_interceptors``
    the family runs its transformer blocks through ``omniloop.run_blocks`` (cache-dit, fbcache).
``adapters``
    :class:`AdapterSupport`: LoRA adapters on the named components' linears (applied by the
    omniloop-adapters plugin).
``offload``
    :class:`OffloadSupport`: the components ``offload: model | sequential`` may move (and the block
    list streamed per component), plus an optional ``refusal(mode, options)`` (moved by the
    omniloop-offload plugin).
``parallel``
    :class:`ParallelSupport`: the ``parallel: {sp, cfg}`` axes, their limits, how to count a
    checkpoint's attention heads (needed for ``sp``), whether block interceptors are bound to the
    sequence-parallel group.
``attention_grid``
    ``refusal(deploy, options) -> str | None``: the family passes each self-attention call's token
    grid to a backend that asks for it (``sparse-tile``) except where the refusal objects; None: it
    passes none, and such a backend is refused.
``weight_update_refusal``
    ``refusal(options) -> str | None``: why :meth:`omniloop.Runtime.update_weights` (new weights or
    an adapter registered at run time) cannot apply to a deployment with these family options —
    e.g. fused Q/K/V projections keep a concatenated copy of the separate weights that an update
    would leave stale. None: updates always apply.
``role_components``
    components whose stages may run in role workers (``placement``).
``quant_blocks``
    ``{component: block list path(s)}`` the ``linear_precision: fp8`` plugin quantises (None: it
    falls back to the adapter and offload declarations).
``returns_latents``
    the default pipeline serves ``outputs.return_latents`` (the final latents as an output).
``audio``
    the family makes audio (an ``audio`` artifact, :class:`omniloop.artifacts.Audio`) and reads the
    request's ``audio`` window: for ``t2a``, and for the tasks in ``audio_tasks``. A request with
    ``audio`` for any other task is refused (:meth:`FamilyCapabilities.makes_audio`); a family that
    does ``t2a`` must declare it.
``streams_partial``
    the default pipeline emits partial artifacts (``outputs.stream_partial``: text as it decodes).
``rollouts``
    the values of the deploy's ``options.rollout`` (a :class:`Rollout` each, the first is the
    default); empty: the family takes no ``options.rollout``. Each rollout says whether it serves
    ``outputs.return_latents`` and whether it streams partial artifacts.
``rollout_support``
    :class:`omniloop.rl.RolloutSupport`: the loop nodes that run post-training rollouts (request
    ``rollout``: per-step log-probs, trajectories) and how to (un)pack their latents; None: a
    request with ``rollout`` is refused.
``step_batch_retry_alone``
    the loop nodes (by name) whose ``step_batch`` changes no request state until its batched
    forward has returned: when that forward raises, the runtime runs each request's step alone, so
    only the request that causes the exception fails (its batch-mates go on as they would alone).
    A node not named here fails its whole batch on such an exception (nobody knows whose row it was).
``checkpoint_limits``
    ``checkpoint_limits(path) -> omniloop.limits.ModelLimits | None``: the range a checkpoint without
    an ``omniloop.json`` declaration was trained for, read from its configs (a real model's sample
    sizes; the families on ``omniloop-kit`` declare ``enforce="warn"``: outside runs, bounded by the
    deploy's limits, with one warning); None: only ``omniloop.json`` declares a range.
``options``
    the keys of the deploy's ``options`` the family reads (None: not declared, nothing checked);
    any other key is refused when the deployment is resolved, naming it and the family.
``audio_guidance``
    with ``audio``: the family reads the audio branch's guidance knobs of the request's ``audio``
    (``guidance``, ``stg``, ``modality``, ``rescale``: a joint audio-video model such as LTX-2);
    a request setting one for any other family is refused (``audio.<knob>``).
``audio_tasks``
    with ``audio``: the tasks besides ``t2a`` whose output also holds the ``audio`` artifact (a
    video with a sound track: a joint audio-video family lists ``t2v``). Front ends read
    :meth:`FamilyCapabilities.makes_audio` to pick the output file type (an mp4 with an AAC track).
``actions``
    the family takes action-conditioned requests (``OmniRequest.action``, :class:`omniloop.request.ActionParams`)
    and may write an ``action`` artifact (:class:`omniloop.artifacts.Action`); the core refuses
    ``action`` for every other family.
``inspect`` / ``resolve`` / ``supported_tasks`` / ``task_defaults``
    the family defines that optional method (see :class:`omniloop.family.Family`).

Families written before this declaration existed (optional attributes such as
``adapter_support``, ``offload_components``, ``parallel_axes`` set on the family object) still
register for one release: :func:`declare` converts them and warns
:class:`FamilyDeprecationWarning`. A family that has both ``capabilities`` and one of the old
attributes is refused (one of the two would be silently ignored).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field

from .errors import PluginError

#: the parallel axes the core knows; a family declares the subset it implements
AXES = ("sp", "cfg")

#: the optional family methods a declaration names
OPTIONAL_METHODS = ("inspect", "resolve", "supported_tasks", "task_defaults")

#: attributes families set before :class:`FamilyCapabilities` (converted by :func:`declare`)
LEGACY_ATTRIBUTES = (
    "supports_block_interceptors", "adapter_support", "offload_components", "offload_refusal",
    "parallel_axes", "parallel_limits", "attention_heads", "parallel_block_interceptors",
    "role_components", "quant_blocks", "attention_grid_refusal", "rollout_support",
)


class FamilyDeprecationWarning(DeprecationWarning):
    """A family registered with the pre-0.2 optional attributes instead of ``capabilities``."""


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only copy of ``value``."""
    return types.MappingProxyType(dict(value or {}))


def _optional_map(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return None if value is None else _frozen_map(value)


def _name_set(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _task_names(value: Iterable[Any]) -> frozenset[str]:
    """Task names (``"t2v"``), given as strings or ``TaskType`` members."""
    return frozenset(str(getattr(t, "value", t)) for t in value)


def _optional_set(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else frozenset(value)


@define(frozen=True)
class AdapterSupport:
    """LoRA adapters (``FamilyCapabilities.adapters``; the omniloop-adapters plugin applies them).

    ``components``: the loaded components adapters may target (diffusers' key prefixes,
    ``transformer``). ``convert(state_dict)``: other key layouts (kohya, ComfyUI) to diffusers'
    — returns ``(state_dict with <component>.<module>.lora_A/B.weight keys, {"<component>.<module>":
    alpha})`` and raises :class:`AdapterFormatError` naming keys it does not know. ``check(model,
    options)``: refuses model options adapters cannot run with (fused projections)."""

    components: tuple[str, ...] = ("transformer",)
    convert: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, float]]] | None = None
    check: Callable[[Any, Mapping[str, Any]], None] | None = None


class AdapterFormatError(ValueError):
    """A LoRA file whose keys or shapes cannot be used (the message names them)."""


def unknown_keys_error(keys: Sequence[str], layout: str) -> AdapterFormatError:
    shown = ", ".join(sorted(keys)[:5])
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return AdapterFormatError(f"{len(keys)} key(s) not understood as {layout} LoRA: {shown}{more}")


@define(frozen=True)
class OffloadSupport:
    """What ``offload: model | sequential`` may move: ``components`` maps a component name to the
    path of its block list (``"blocks"``; several as a tuple) streamed under ``sequential``, or None
    for a component moved whole. ``refusal(mode, options)`` returns a reason string when the
    family ``options`` forbid that mode (Wan: the causal rollout cannot stream its blocks)."""

    components: Mapping[str, str | tuple[str, ...] | None] = field(converter=_frozen_map)
    refusal: Callable[[str, Mapping[str, Any]], str | None] | None = None


@define(frozen=True)
class ParallelSupport:
    """``parallel: {sp, cfg}``: the ``axes`` implemented, the most ranks per axis (``limits``),
    ``attention_heads(path)`` (the transformer's heads, which ``sp`` must divide; required with
    ``sp``), and ``block_interceptors``: block interceptors are bound to the sp group so every rank
    takes the same skip decision."""

    axes: frozenset[str] = field(converter=frozenset)
    limits: Mapping[str, int] = field(factory=dict, converter=_frozen_map)
    attention_heads: Callable[[Path], int | None] | None = None
    block_interceptors: bool = False


@define(frozen=True)
class Rollout:
    """One value of ``options.rollout``: ``returns_latents`` — it serves ``outputs.return_latents``;
    ``streams`` — it emits partial artifacts as it goes (chunks of a video)."""

    name: str
    returns_latents: bool = False
    streams: bool = False
    description: str = ""


@define(frozen=True)
class FamilyCapabilities:
    """Everything optional a family can do (see the module docstring); frozen, checked at registration."""

    block_interceptors: bool = False
    adapters: AdapterSupport | None = None
    offload: OffloadSupport | None = None
    parallel: ParallelSupport | None = None
    attention_grid: Callable[[Any, Mapping[str, Any]], str | None] | None = None
    weight_update_refusal: Callable[[Mapping[str, Any]], str | None] | None = None
    role_components: frozenset[str] = field(default=frozenset(), converter=frozenset)
    quant_blocks: Mapping[str, str | tuple[str, ...]] | None = field(default=None, converter=_optional_map)
    returns_latents: bool = False
    audio: bool = False
    streams_partial: bool = False
    rollouts: tuple[Rollout, ...] = field(default=(), converter=tuple)
    options: frozenset[str] | None = field(default=None, converter=_optional_set)
    rollout_support: Any = None  # omniloop.rl.RolloutSupport | None (typed loosely: no import cycle)
    step_batch_retry_alone: frozenset[str] = field(default=frozenset(), converter=_name_set)
    audio_tasks: frozenset[str] = field(default=frozenset(), converter=_task_names)
    audio_guidance: bool = False
    #: action-conditioned requests (``OmniRequest.action``) and an ``action`` artifact (:class:`omniloop.artifacts.Action`)
    actions: bool = False
    checkpoint_limits: Callable[[Path], Any] | None = None  # -> omniloop.limits.ModelLimits | None
    inspect: bool = False
    resolve: bool = False
    supported_tasks: bool = False
    task_defaults: bool = False

    def methods(self) -> tuple[str, ...]:
        """The optional methods declared."""
        return tuple(m for m in OPTIONAL_METHODS if getattr(self, m))

    def makes_audio(self, task: Any) -> bool:
        """Whether a ``task`` request's output holds an ``audio`` artifact (and the request may
        carry an ``audio`` window): a family declaring ``audio``, for ``t2a`` and its ``audio_tasks``."""
        value = str(getattr(task, "value", task))
        return self.audio and (value == "t2a" or value in self.audio_tasks)

    def check_options(self, family: str, options: Mapping[str, Any]) -> None:
        """Refuse (one :class:`~omniloop.errors.DeployError` line) a family option the family does
        not read, when it declares its ``options``; nothing is ignored silently."""
        from .errors import DeployError

        if self.options is None:
            return
        unknown = sorted(set(options) - self.options - ({"rollout"} if self.rollouts else set()))
        if unknown:
            takes = ", ".join(sorted(self.options)) or "none"
            raise DeployError(f"options.{unknown[0]}: family {family!r} does not read this option (it reads: {takes})")

    def rollout(self, family: str, options: Mapping[str, Any]) -> Rollout:
        """The rollout the family ``options`` choose (``options.rollout``), checked: a family that
        declares no rollouts takes no ``options.rollout``; an unknown name is refused. Raises
        :class:`~omniloop.errors.DeployError` naming the option and the family."""
        from .errors import DeployError

        chosen = options.get("rollout")
        if not self.rollouts:
            if chosen is not None:
                raise DeployError(
                    f"options.rollout: family {family!r} has a single rollout and takes no options.rollout "
                    f"(got {chosen!r}); remove it"
                )
            return Rollout(name="default", returns_latents=self.returns_latents, streams=self.streams_partial)
        if chosen is None:
            return self.rollouts[0]
        for r in self.rollouts:
            if r.name == chosen:
                return r
        names = ", ".join(r.name for r in self.rollouts)
        raise DeployError(f"options.rollout: family {family!r} has no rollout {chosen!r} (rollouts: {names})")


def validate(family: Any, caps: Any) -> FamilyCapabilities:
    """``caps`` checked against ``family``; raises :class:`PluginError` (one line naming the field)
    when the family declares what it cannot serve, or defines an optional method it does not declare."""
    name = _name(family)
    where = f"family {name!r}: capabilities"
    if not isinstance(caps, FamilyCapabilities):
        raise PluginError(f"{where} must be an omniloop.capabilities.FamilyCapabilities, not {type(caps).__name__}")
    members = dir(family)
    for m in OPTIONAL_METHODS:
        has = m in members and callable(getattr(family, m))  # contract: registration checks the object once
        if getattr(caps, m) and not has:
            raise PluginError(f"{where}.{m} is declared but the family defines no {m}() method")
        if has and not getattr(caps, m):
            raise PluginError(f"{where}.{m}: the family defines {m}() but does not declare it ({m}=True)")
    if caps.adapters is not None and not tuple(caps.adapters.components):
        raise PluginError(f"{where}.adapters names no components")
    if caps.offload is not None and not caps.offload.components:
        raise PluginError(f"{where}.offload names no components")
    par = caps.parallel
    if par is not None:
        bad = sorted(par.axes - set(AXES))
        if bad or not par.axes:
            raise PluginError(f"{where}.parallel.axes: {bad[0] if bad else 'none'!r} is not a parallel axis "
                              f"(axes: {', '.join(AXES)})")
        for axis, most in par.limits.items():
            if axis not in par.axes:
                raise PluginError(f"{where}.parallel.limits.{axis}: not a declared axis")
            if not isinstance(most, int) or isinstance(most, bool) or most < 1:
                raise PluginError(f"{where}.parallel.limits.{axis}: expected an integer >= 1, got {most!r}")
        if "sp" in par.axes and not callable(par.attention_heads):
            raise PluginError(f"{where}.parallel: 'sp' needs attention_heads(path) (sp must divide the heads)")
        if par.block_interceptors and not caps.block_interceptors:
            raise PluginError(f"{where}.parallel.block_interceptors: the family does not run block interceptors "
                              "(block_interceptors=False)")
    for fn_name, fn in (("attention_grid", caps.attention_grid), ("checkpoint_limits", caps.checkpoint_limits),
                        ("weight_update_refusal", caps.weight_update_refusal),
                        ("offload.refusal", caps.offload.refusal if caps.offload else None)):
        if fn is not None and not callable(fn):
            raise PluginError(f"{where}.{fn_name}: expected a callable, got {type(fn).__name__}")
    # rollout_support (an omniloop.rl.RolloutSupport) is checked by omniloop.plugins at registration:
    # rl reads this module, so this module does not import rl (issue 34: no import cycle)
    if any(not isinstance(n, str) or not n for n in caps.step_batch_retry_alone):
        raise PluginError(f"{where}.step_batch_retry_alone: expected loop node names")
    tasks = {str(getattr(t, "value", t)) for t in getattr(family, "tasks", ())}
    if caps.audio_tasks and not caps.audio:
        raise PluginError(f"{where}.audio_tasks: the family declares audio=False (audio_tasks needs audio=True)")
    if "t2a" in tasks and not caps.audio:
        raise PluginError(f"{where}.audio: the family does t2a, so it makes audio: declare audio=True")
    stray = sorted(caps.audio_tasks - tasks)
    if stray:
        raise PluginError(f"{where}.audio_tasks: {stray[0]!r} is not one of the family's tasks "
                          f"({', '.join(sorted(tasks)) or 'none'})")
    if any(not isinstance(c, str) or not c for c in caps.role_components):
        raise PluginError(f"{where}.role_components: expected component names")
    names = [r.name for r in caps.rollouts]
    if len(set(names)) != len(names) or any(not isinstance(r, Rollout) for r in caps.rollouts):
        raise PluginError(f"{where}.rollouts: expected Rollout records with distinct names")
    for what, own in (("returns_latents", "returns_latents"), ("streams_partial", "streams")):
        if caps.rollouts and getattr(caps.rollouts[0], own) != getattr(caps, what):
            raise PluginError(f"{where}.{what} must equal the default rollout's ({caps.rollouts[0].name!r}) {own}")
    legacy = [a for a in LEGACY_ATTRIBUTES if a in members]
    if legacy:
        raise PluginError(f"family {name!r} declares capabilities and the old attribute {legacy[0]!r}; "
                          "move it into capabilities (omniloop.capabilities.FamilyCapabilities)")
    return caps


def declare(family: Any) -> FamilyCapabilities:
    """The family's validated declaration. A family without ``capabilities`` but with the pre-0.2
    optional attributes is converted (warning :class:`FamilyDeprecationWarning` once) and the
    result attached to the object where it can be."""
    if "capabilities" in dir(family):
        return validate(family, family.capabilities)
    caps = _from_legacy_attributes(family)
    warnings.warn(
        f"family {_name(family)!r} declares its capabilities with attributes "
        "(supports_block_interceptors, adapter_support, offload_components, ...); declare "
        "capabilities = omniloop.capabilities.FamilyCapabilities(...) instead (the attributes stop working in 0.3)",
        FamilyDeprecationWarning, stacklevel=3,
    )
    try:
        family.capabilities = caps
    except (AttributeError, TypeError, attrs.exceptions.FrozenInstanceError):
        pass  # a frozen or slotted object: converted again (and warned) when asked again
    return caps


def capabilities_of(family: Any) -> FamilyCapabilities:
    """What ``family`` declares: its ``capabilities`` (checked at registration), or the conversion
    of an old-style family (see :func:`declare`). The one way the core and plugins read them."""
    if "capabilities" in dir(family):
        caps = family.capabilities
        if not isinstance(caps, FamilyCapabilities):
            raise PluginError(f"family {_name(family)!r}: capabilities must be an "
                              f"omniloop.capabilities.FamilyCapabilities, not {type(caps).__name__}")
        return caps
    return declare(family)


def _name(family: Any) -> str:
    return str(getattr(family, "name", type(family).__name__))


def _from_legacy_attributes(family: Any) -> FamilyCapabilities:
    """The pre-0.2 attributes as a declaration (the deprecation shim; the one place that reads
    optional attributes of a family object)."""
    def attr(name: str, default: Any = None) -> Any:
        return getattr(family, name, default)

    offload_components = attr("offload_components")
    axes = frozenset(attr("parallel_axes", ()) or ())
    heads = attr("attention_heads")
    grid = attr("attention_grid_refusal")
    return FamilyCapabilities(
        block_interceptors=bool(attr("supports_block_interceptors", False)),
        adapters=attr("adapter_support"),
        offload=OffloadSupport(components=dict(offload_components), refusal=attr("offload_refusal"))
        if offload_components else None,
        parallel=ParallelSupport(axes=axes, limits=dict(attr("parallel_limits", {}) or {}),
                                 attention_heads=heads if callable(heads) else None,
                                 block_interceptors=bool(attr("parallel_block_interceptors", False)))
        if axes else None,
        attention_grid=grid if callable(grid) else None,
        role_components=frozenset(attr("role_components", ()) or ()),
        quant_blocks=attr("quant_blocks"),
        rollout_support=attr("rollout_support"),
        returns_latents=True, streams_partial=True,  # old families were never asked: nothing newly refused
        inspect=callable(attr("inspect")), resolve=callable(attr("resolve")),
        supported_tasks=callable(attr("supported_tasks")), task_defaults=callable(attr("task_defaults")),
    )
