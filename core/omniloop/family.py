"""What a model family provides, and the records the registration hooks take.

A family plugin registers a :class:`Family` object through ``omniloop_register_families``. The
runtime asks it to ``load`` a checkpoint once (components shared by reference between
pipelines) and to ``build_pipeline`` per task. What it can do beyond the required methods is one
frozen declaration, ``capabilities`` (:class:`omniloop.capabilities.FamilyCapabilities`: block
interceptors, adapters, offload, parallel axes, attention grid, role components, quantisable
blocks, rollouts, latents, optional methods), checked when the family registers; the core and the
plugins read that declaration and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
from attrs import define

from .capabilities import FamilyCapabilities
from .graph import PipelineSpec
from .request import OmniRequest, TaskType

if TYPE_CHECKING:
    import torch


def _cpu() -> torch.device:
    import torch  # on first use: registering a family imports no torch (issue 42)

    return torch.device("cpu")


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@define
class LoadedModel:
    """A family's loaded checkpoint: named components (``transformer``, ``vae``, ...) and config."""

    family: str
    path: Path | None
    components: dict[str, Any]
    config: dict[str, Any] = attrs.Factory(dict)
    device: torch.device = attrs.Factory(_cpu)
    dtype: torch.dtype = attrs.Factory(_float32)
    #: identity of the weights, for caches keyed by weight version (e.g. a hash of the files)
    weight_version: str = ""
    #: the tasks *this checkpoint* supports (a T2V checkpoint of a family that also does I2V);
    #: None means every task the family declares
    tasks: frozenset[TaskType] | None = None
    #: resolved defaults per task (steps, guidance_scale, height, width, frames, fps, ...)
    defaults: dict[TaskType, dict[str, Any]] = attrs.Factory(dict)


@runtime_checkable
class Family(Protocol):
    name: str
    tasks: frozenset[TaskType]
    #: everything optional the family can do (``omniloop.capabilities``); checked at registration
    capabilities: FamilyCapabilities

    def detect(self, path: Path) -> bool:
        """True when ``path`` looks like a checkpoint of this family (cheap: reads config files)."""

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Load every component once. Raise ``CheckpointError`` naming the file on bad input."""

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """The validated pipeline for ``task`` (policies and defaults resolved here)."""

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        """Warnings for the request (e.g. prompt truncated); raise ``RequestError`` when invalid.

        Runs before any compute."""

    # Optional methods, each declared in ``capabilities`` (``inspect=True``, ...; registration fails
    # when a declared one is missing or a defined one is undeclared):
    #
    # def resolve(self, model, request, limits, *, node_params) -> Resolved:
    #     """The request resolved once (``omniloop.resolved.Resolved``); without it the core's
    #     ``GenericResolved`` reads ``task_defaults``."""
    #
    # def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
    #     """Defaults for the fields a request leaves unset (steps, size, frames, fps, ...)."""
    #
    # (Post-training rollouts, ``request.rollout``; docs/rl.md: declared as
    # ``capabilities.rollout_support``, an ``omniloop.rl.RolloutSupport``.)
    #
    # def supported_tasks(self, model: LoadedModel) -> Iterable[TaskType]:
    #     """The tasks this checkpoint can do (default: ``model.tasks``, ``model.config["tasks"]``,
    #     else ``tasks``). ``Runtime.supported_tasks`` reports it; servers advertise it."""
    #
    # def inspect(self, path: Path, *, options: dict[str, Any]) -> LoadedModel:
    #     """A config-only ``LoadedModel`` (no components, no weights read) on which
    #     ``validate_request`` and ``supported_tasks`` work. With it, ``omniloop.Deployment.check``
    #     (and ``omniloop generate``) run the family's request checks before loading anything."""


@define(frozen=True)
class ModelPreset:
    """A named model (``wan-demo``) resolving to a family and a local checkpoint path."""

    name: str
    family: str
    path: Callable[[], Path]
    description: str = ""
    #: family options the preset runs best with (e.g. ``{"vae_cpu_kernels": "fast"}``); a
    #: deployment's own ``options`` override them key by key
    options: dict[str, Any] = attrs.field(factory=dict)
    #: LoRA adapters the preset offers (``{NAME: path callable}``, e.g. wan-demo's ``fast``): they
    #: join a deployment's ``adapters`` when omniloop-adapters is installed, the file exists and the
    #: deployment leaves adapters free (fuses none, ``offload: none``, ``linear_precision: dtype``,
    #: no CUDA-graph compile); see ``Deployment.offered_adapters``
    adapters: dict[str, Callable[[], Path]] = attrs.field(factory=dict)
    #: a preset that IS its base plus one of its adapters fused at load (``{NAME: SCALE}``, the
    #: deploy's ``adapter_fuse``; e.g. wan-demo-fast = wan-demo + ``fast``): required, not offered
    adapter_fuse: dict[str, float] = attrs.field(factory=dict)


@define(frozen=True)
class PolicySpec:
    """A policy registered by name: ``kind`` is ``sampler``, ``cfg``, ``shift``, ``router``, ..."""

    name: str
    kind: str
    factory: Callable[..., Any]
    params_schema: type | None = None
    description: str = ""


@define(frozen=True)
class PluginComponentSpec:
    """An interceptor or observer a deploy config may enable by ``name``.

    ``factory(config)`` builds the object from the deploy's config (validated against
    ``config_schema``); a request may tune it with ``plugin_params[name]`` validated against
    ``params_schema``.
    """

    name: str
    kind: str  # "block_interceptor" | "step_interceptor" | "observer"
    factory: Callable[[Any], Any]
    config_schema: type | None = None
    params_schema: type | None = None
    distribution_altering: bool = False
    description: str = ""


@define(frozen=True)
class RunOptionSpec:
    """A flag a plugin adds to ``omniloop generate`` (``--<name>``), e.g. the profiler's ``--profile``.

    ``enable(deploy, out)`` returns the deploy with the plugin enabled for this run (``out``: the
    run's output file, to name a report beside it); ``report(runtime, output, out, quiet)`` runs
    after the request and returns the files it wrote by label (it prints unless ``quiet``)."""

    name: str
    enable: Callable[[Any, Path], Any]
    report: Callable[[Any, Any, Path, bool], dict[str, Path]] | None = None
    help: str = ""


@define(frozen=True)
class SchedulerSpec:
    name: str
    factory: Callable[..., Any]
    description: str = ""


@define(frozen=True)
class TransportSpec:
    name: str
    factory: Callable[..., Any]
    description: str = ""


@define(frozen=True)
class RuntimeLoaderSpec:
    """A loader for deploys a single-process :class:`~omniloop.runtime.Runtime` does not run
    (``Runtime.from_deploy`` hands them over): omniloop-compose's composed pipelines (``pipeline``),
    omniloop-parallel's worker pools (``parallel`` above one process, ``placement``).

    ``fields``: the deploy fields it serves (see ``omniloop.runtime.ROUTED``). ``claims(deploy)``:
    whether it loads this deploy. ``load(deploy, manager=)``: the runtime. ``deployment(deploy,
    manager=)``: the weight-free view whose ``check(request)`` front ends call (None: the plain
    ``Deployment`` with ``check``). ``check(deployment, block_interceptors)``: raises one
    :class:`~omniloop.errors.DeployError` for a layout that cannot run, before any weight loads.
    ``check_direct(deploy)``: called when a plain ``Runtime`` is built for a deploy it claims
    (raise unless it is one of this loader's own worker processes).
    """

    name: str
    fields: tuple[str, ...]
    claims: Callable[[Any], bool]
    load: Callable[..., Any]
    deployment: Callable[..., Any] | None = None
    check: Callable[[Any, tuple[str, ...]], None] | None = None
    check_direct: Callable[[Any], None] | None = None
    description: str = ""


@define(frozen=True)
class MechanismSpec:
    """A load-time mechanism a deploy field turns on, which only some deployments use: LoRA
    ``adapters`` (omniloop-adapters), ``offload`` (omniloop-offload); or a runtime method's
    implementation (``weights``: omniloop-rl's ``update_weights`` / ``weights_checksum``). Registered through
    ``omniloop_register_mechanisms`` (hook API 1.4); the core keeps the field and refuses a deploy
    that sets it while no mechanism serves it, naming the package (``omniloop.runtime.MECHANISMS``).

    ``name``: the deploy field it serves. ``check(deployment)``: weight-free checks when a
    ``Deployment`` is built (one :class:`~omniloop.errors.DeployError`). ``check_request(deployment,
    request)``: a request's checks that need no weights. ``storage_device(deploy, device)``: where the
    family loads its weights. ``install(runtime)``: after the family loaded, in ``order``; the
    installed :class:`Mechanism`, or None when the deploy does not use it. ``update(runtime, name,
    source)``: ``Runtime.update_weights(source, adapter=name)``: reads and checks ``source``, returns
    the function that applies it between requests (``name`` "" for the ``weights`` mechanism: the
    denoiser's own). ``fingerprint(runtime, extra, algorithm)``: ``Runtime.weights_checksum``.
    """

    name: str
    check: Callable[[Any], None] | None = None
    check_request: Callable[[Any, OmniRequest], None] | None = None
    storage_device: Callable[[Any, Any], Any] | None = None
    install: Callable[[Any], Mechanism | None] | None = None
    update: Callable[[Any, str, Any], Callable[[], None]] | None = None
    fingerprint: Callable[[Any, list[tuple[str, Any]], str], str] | None = None
    order: int = 0
    description: str = ""


@define(frozen=True)
class RequestScope:
    """What one request runs with, around each unit of its execution (its LoRA set): ``activate()``
    is the context entered around every call; ``key`` joins the batch key (a batch never mixes scopes)."""

    key: Any
    activate: Callable[[], Any]


class Mechanism:
    """An installed :class:`MechanismSpec`; each method's default does nothing."""

    def wrap_pipeline(self, spec: PipelineSpec) -> PipelineSpec:
        """The pipeline every task builds, wrapped (offload: nodes move their components)."""
        return spec

    def request_scope(self, request: OmniRequest) -> RequestScope | None:
        return None

    def checksum_items(self) -> list[tuple[str, Any]]:
        """``(name, tensor)`` (or ``("", text)``) added to ``Runtime.weights_checksum``."""
        return []

    def describe(self) -> Any:
        return None


@define(frozen=True)
class LinearPrecisionSpec:
    """A way to compute the denoiser's linear layers, named by the deploy's ``linear_precision``
    (``dtype``, the deploy's own dtype, is built in and needs no spec).

    ``check(deploy, family, device, dtype)`` raises one :class:`~omniloop.errors.DeployError` when it
    cannot run in that deployment (called at load, before any weight is read); ``apply(model,
    family, deploy)`` converts the loaded model in place right after the family loads it (before
    any block is compiled) and returns a JSON-able report. A ``distribution_altering`` precision
    (anything but exact arithmetic) is refused for ``exact: true`` requests. The deploy's
    ``linear_precision_options`` are checked against ``options_schema`` before ``check`` runs.
    """

    name: str
    check: Callable[[Any, Any, Any, Any], None]
    apply: Callable[[Any, Any, Any], dict[str, Any] | None]
    distribution_altering: bool = True
    description: str = ""
    #: attrs class of the deploy's ``linear_precision_options`` for this precision (None: it takes
    #: none); validated at load before ``check`` (ranges in field metadata), so ``check`` and
    #: ``apply`` may structure ``deploy.linear_precision_options`` with it again without failing.
    #: Since hook API 1.5
    options_schema: type | None = None


@define(frozen=True)
class AttentionBackendSpec:
    """An attention implementation: ``fn(q, k, v) -> out`` with q/k/v ``[B, heads, L, D]``.

    ``available()`` says whether it can run here (a reason string when it cannot). A deploy that
    names an unavailable backend fails at load with that reason, never a silent fallback.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    available: Callable[[], str | None] = lambda: None
    distribution_altering: bool = False
    description: str = ""
    #: attrs class of the deploy's ``attention_options`` for this backend (None: it takes none);
    #: validated at load like plugin configs (ranges in field metadata)
    options_schema: type | None = None
    #: ``configure(options) -> fn``: the callable for the validated ``attention_options`` (at load;
    #: the runtime's spec then carries it as ``fn``). A ``ValueError`` is a deploy error.
    configure: Callable[[Any], Callable[..., torch.Tensor]] | None = None
    #: ``attention_backend: auto`` (the deploy default) runs, of the backends with ``auto_rank > 0``
    #: that are exact-class, take no options, are ``available()`` and accept the deploy
    #: (``auto_accepts(deploy)`` is None), the one of highest rank (ties: by name); if none, the
    #: core ``sdpa``. Give a rank only with a measurement showing the backend faster than ``sdpa``
    #: wherever it accepts (``omniloop.runtime.resolve_auto_attention``).
    auto_rank: int = 0
    #: ``auto_accepts(deploy, family) -> None`` (auto may pick it for this deploy and family name) or
    #: the reason it may not (a dtype, device or family it was not measured on); None: any deploy
    auto_accepts: Callable[[Any, str], str | None] | None = None
