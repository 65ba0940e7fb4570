"""omniloop's hook points. The single reference for plugin authors.

Hook-API version: :data:`HOOK_API_VERSION`. Rules (pytest's way):

* hooks grow, they never break: a new argument is added to a spec in a minor version; pluggy lets
  an implementation accept fewer arguments than the spec, so old plugins keep working;
* removing or changing the meaning of an argument is a major version, after a minor version that
  warns with :class:`omniloop.errors.HookDeprecationWarning`: a renamed hook is listed in
  :data:`RENAMED_HOOKS` (old name → new name) for that minor version, and a plugin implementing the
  old name is registered under the new one with the warning; a changed plugin-method signature
  (interceptors' ``open(step, loop)`` → ``open(step, loop, params)``) is adapted the same way;
* every hook's docstring says what its return value means and ``Since:`` the version it exists.

A plugin declares the range it supports with a module attribute, e.g.
``OMNILOOP_HOOK_API = ">=1.0,<2"``; outside it the plugin is refused with a message saying what it
needs.

Registration hooks are called once when a deployment loads, with a ``register`` callback the core
owns (it dedupes and names both providers on a clash). They must be fast and offline: no weights,
no network, no heavy imports.

Observer events are read-only. They are bound when a pipeline is built: an event that no enabled
observer implements is not called at all, so it costs nothing in the step loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from .deploy import DeployConfig
from .family import (
    AttentionBackendSpec,
    Family,
    LinearPrecisionSpec,
    MechanismSpec,
    ModelPreset,
    PluginComponentSpec,
    PolicySpec,
    RunOptionSpec,
    RuntimeLoaderSpec,
    SchedulerSpec,
    TransportSpec,
)
from .graph import PipelineSpec
from .loop import LoopState, StepContext
from .request import OmniOutput, OmniRequest
from .scheduling import ScheduleDecision

PROJECT = "omniloop"
#: this core's hook-API version; bump the minor for every hook or hook argument added (see
#: :data:`HOOK_API_HISTORY`), the major only to remove one after a minor version that warned
HOOK_API_VERSION = "1.5"

#: what each hook-API version added (newest last); a version's entry says what a plugin that
#: declares ``>=<version>`` may rely on
HOOK_API_HISTORY: dict[str, str] = {
    "1.0": "the registration hooks and observer events of this module",
    "1.1": "omniloop_request_start(..., plugin_params); omniloop_register_run_options; interceptors' "
           "open(step, loop, params) (open(step, loop) warns HookDeprecationWarning)",
    "1.2": "omniloop_register_linear_precisions (the deploy's linear_precision: e.g. omniloop-quant's fp8)",
    "1.3": "omniloop_register_runtime_loaders (Runtime.from_deploy hands composed, parallel and role-pool "
           "deploys to the plugin that registered their loader: omniloop-compose, omniloop-parallel)",
    "1.4": "omniloop_register_mechanisms (load-time mechanisms a deploy field turns on: omniloop-adapters' "
           "adapters, omniloop-offload's offload)",
    "1.5": "LinearPrecisionSpec.options_schema (the deploy's linear_precision_options, checked at load: "
           "omniloop-quant's fp8 keep)",
}

#: hook arguments added after their hook: hook -> {argument: the version that added it}. An
#: implementation taking one of these needs that version: declare ``OMNILOOP_HOOK_API = ">=1.1,<2"``
#: (a core before it would refuse the implementation's signature)
ARGUMENTS_SINCE: dict[str, dict[str, str]] = {
    "omniloop_request_start": {"plugin_params": "1.1"},
}

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def registering(*items: Any) -> Any:
    """A registration hook's implementation that registers ``items`` (specs, families, presets), for
    a plugin module whose hook does nothing else: ``omniloop_register_observers = registering(SPEC)``
    (pluggy matches it by the name it is bound to)."""

    @hookimpl
    def register_items(register: Any) -> None:
        for item in items:
            register(item)

    return register_items

# ============================================================================================
# Registration
# ============================================================================================


@hookspec
def omniloop_register_families(register: Callable[[Family], None]) -> None:
    """Register model families: ``register(family)`` with an :class:`omniloop.family.Family`.

    The family's ``capabilities`` (:class:`omniloop.capabilities.FamilyCapabilities`) are checked
    here: a declaration the family cannot serve fails the registration (the plugin is listed as
    failed with one line naming the field). Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_model_presets(register: Callable[[ModelPreset], None]) -> None:
    """Register named models: ``register(ModelPreset(name, family, path))``.

    A preset lets ``--model NAME`` resolve to a local checkpoint shipped as package data; its
    optional ``options`` are family options it runs best with, under the deployment's own
    ``options`` (which win key by key). Its optional ``adapters`` (``{NAME: path callable}``) are
    LoRA adapters it offers, joining the deployment's ``adapters`` when omniloop-adapters is
    installed; ``adapter_fuse`` makes the preset its base with one of them fused at load (e.g.
    ``wan-demo-fast`` = ``wan-demo`` + ``fast``). Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_policies(register: Callable[[PolicySpec], None]) -> None:
    """Register policies (samplers, CFG policies, shift, routing): ``register(PolicySpec(...))``.

    A ``PolicySpec`` of ``kind="pipeline"`` registers a composition a deploy names with
    ``pipeline:`` (its factory returns an ``omniloop_compose.CompositionSpec``).

    Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_interceptors(register: Callable[[PluginComponentSpec], None]) -> None:
    """Register block or step interceptors: ``register(PluginComponentSpec(kind=...))``.

    Only those a deploy config enables are instantiated. Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_observers(register: Callable[[PluginComponentSpec], None]) -> None:
    """Register observers: ``register(PluginComponentSpec(kind="observer", ...))``.

    The factory returns an object whose methods implement the observer events below (decorated
    with ``hookimpl``). Only those a deploy config enables are instantiated. Returns nothing.
    Since: 1.0
    """


@hookspec
def omniloop_register_schedulers(register: Callable[[SchedulerSpec], None]) -> None:
    """Register execution schedulers: ``register(SchedulerSpec(name, factory))``.

    Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_transports(register: Callable[[TransportSpec], None]) -> None:
    """Register transports for cross-process edges: ``register(TransportSpec(name, factory))``.

    Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    """Register attention implementations: ``register(AttentionBackendSpec(name, fn, available))``.

    Returns nothing. Since: 1.0
    """


@hookspec
def omniloop_register_linear_precisions(register: Callable[[LinearPrecisionSpec], None]) -> None:
    """Register ways to compute the denoiser's linears, chosen by the deploy's ``linear_precision``:
    ``register(LinearPrecisionSpec(name, check, apply))`` (``dtype`` is built in). A spec with an
    ``options_schema`` (hook API 1.5; declare ``OMNILOOP_HOOK_API = ">=1.5,<2"``) takes the deploy's
    ``linear_precision_options``, validated at load.

    Returns nothing. Since: 1.2
    """


@hookspec
def omniloop_register_runtime_loaders(register: Callable[[RuntimeLoaderSpec], None]) -> None:
    """Register a loader for deploys a single-process runtime does not run:
    ``register(RuntimeLoaderSpec(name, fields, claims, load, ...))``.

    ``Runtime.from_deploy`` and ``Deployment`` route a deploy that sets one of the fields in
    ``omniloop.runtime.ROUTED`` (``pipeline``, ``parallel`` above one process, ``placement``) to
    the one loader that ``claims`` it; with none installed the deploy is refused naming the package
    that serves it. The core imports no such plugin. Returns nothing. Since: 1.3
    """


@hookspec
def omniloop_register_mechanisms(register: Callable[[MechanismSpec], None]) -> None:
    """Register a load-time mechanism for a deploy field: ``register(MechanismSpec(name, check,
    install, ...))`` (LoRA ``adapters``, ``offload``). A deploy that sets a field in
    ``omniloop.runtime.MECHANISMS`` with no mechanism installed is refused naming the package that
    serves it. Returns nothing. Since: 1.4
    """


@hookspec
def omniloop_register_run_options(register: Callable[[RunOptionSpec], None]) -> None:
    """Add a flag to ``omniloop generate``: ``register(RunOptionSpec(name, enable, report))``.

    The CLI shows ``--<name>`` only while the plugin is installed; ``enable`` turns the plugin on
    in the run's deploy, ``report`` writes/prints what it measured. Returns nothing. Since: 1.1
    """


@hookspec
def omniloop_register_commands(cli: Any) -> None:
    """Add subcommands to the ``omniloop`` click group ``cli`` (``cli.add_command(...)``).

    (``cli`` is a ``click.Group``; typed ``Any`` because click is the CLI's dependency, not the core's.)

    Called for every discovered plugin when the CLI starts, failure-isolated per plugin.
    Returns nothing. Since: 1.0
    """


# ============================================================================================
# Request events (observers; read-only)
# ============================================================================================


@hookspec
def omniloop_request_start(
    request: OmniRequest, pipeline: PipelineSpec, deploy: DeployConfig | None, plugin_params: Mapping[str, Any]
) -> None:
    """A request starts executing ``pipeline`` (a ``PipelineSpec``) in a deployment whose
    ``DeployConfig`` is ``deploy`` (e.g. for recording what produced a run). ``plugin_params`` are the
    request's plugin params by plugin name, each validated once against that plugin's
    ``params_schema`` (an observer reads its own: ``plugin_params.get("my-observer")``; argument
    since 1.1, so an implementation taking it declares ``>=1.1``). Returns nothing. Since: 1.0"""


@hookspec
def omniloop_request_end(request: OmniRequest, output: OmniOutput) -> None:
    """A request reached a terminal status; ``output`` is its ``OmniOutput``. Returns nothing. Since: 1.0"""


@hookspec
def omniloop_node_start(request: OmniRequest, node: str) -> None:
    """Node ``node`` starts for ``request``. Returns nothing. Since: 1.0"""


@hookspec
def omniloop_node_end(request: OmniRequest, node: str, seconds: float) -> None:
    """Node ``node`` finished for ``request`` after ``seconds`` of wall time. Returns nothing. Since: 1.0"""


# ============================================================================================
# Loop events (observers; read-only)
# ============================================================================================


@hookspec
def omniloop_loop_init(request: OmniRequest, node: str, loop: LoopState) -> None:
    """A loop node's ``init`` returned ``loop`` (a ``LoopState``). Returns nothing. Since: 1.0"""


@hookspec
def omniloop_loop_finalize(request: OmniRequest, node: str, loop: LoopState) -> None:
    """A loop node finished (or was cancelled / failed) with ``loop``. Returns nothing. Since: 1.0"""


@hookspec
def omniloop_step_start(request: OmniRequest, node: str, step: int, total: int) -> None:
    """Step ``step`` (0-based) of ``total`` is about to run. Returns nothing. Since: 1.0"""


@hookspec
def omniloop_step_end(request: OmniRequest, node: str, step: int, total: int, loop: LoopState, seconds: float) -> None:
    """Step ``step`` finished in ``seconds`` (wall, not synchronized). Returns nothing. Since: 1.0"""


# ============================================================================================
# Taps (observers; read-only)
# ============================================================================================


@hookspec
def omniloop_tap(request: OmniRequest, node: str, step: StepContext | None, name: str, value: Any) -> None:
    """A named value offered by a stage: ``step`` is a ``StepContext`` or None; ``name`` is e.g.
    ``noise_pred``, ``guided``, ``latents``, ``blocks.3``, ``video``. Observers must not modify
    ``value``. Returns nothing. Since: 1.0"""


@hookspec
def omniloop_wants_block_taps(node: str) -> re.Pattern[str] | str | None:
    """Return a compiled regex (or pattern string) of block module names whose outputs this
    observer wants as taps, or None. Observers that answer need eager block execution.
    Since: 1.0"""


# ============================================================================================
# Scheduling (observers; read-only)
# ============================================================================================


@hookspec
def omniloop_schedule_decision(decision: ScheduleDecision) -> None:
    """The scheduler decided what runs next: ``decision`` is a ``ScheduleDecision``
    (what ran, which requests, why). Returns nothing. Since: 1.0"""


#: hooks renamed in this major version: old name -> new name. A plugin implementing the old name
#: still works until the next major version and warns HookDeprecationWarning when registered.
RENAMED_HOOKS: dict[str, str] = {}

REGISTRATION_HOOKS = (
    "omniloop_register_families",
    "omniloop_register_model_presets",
    "omniloop_register_policies",
    "omniloop_register_interceptors",
    "omniloop_register_observers",
    "omniloop_register_schedulers",
    "omniloop_register_transports",
    "omniloop_register_attention_backends",
    "omniloop_register_linear_precisions",
    "omniloop_register_runtime_loaders",
    "omniloop_register_mechanisms",
    "omniloop_register_run_options",
    "omniloop_register_commands",
)

OBSERVER_EVENTS = (
    "omniloop_request_start",
    "omniloop_request_end",
    "omniloop_node_start",
    "omniloop_node_end",
    "omniloop_loop_init",
    "omniloop_loop_finalize",
    "omniloop_step_start",
    "omniloop_step_end",
    "omniloop_tap",
    "omniloop_wants_block_taps",
    "omniloop_schedule_decision",
)
