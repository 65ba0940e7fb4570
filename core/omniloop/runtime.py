"""The runtime: loads a deployment, builds pipelines, validates requests, runs them.

``Deployment(deploy)`` resolves a deployment without reading any weights: discover plugins,
resolve the model (preset or path → family), check the device, the attention backend, the
scheduler's name and every enabled plugin's config. ``Deployment.check(request)`` runs every
request check that needs no weights (task, limits, prompt, plugin params, exact-mode rules, and the
family's own checks when the family can ``inspect`` a checkpoint from its config files), so a front
end refuses a bad request before spending seconds loading a model (:func:`check_request`).

``Runtime.from_deploy(deploy)`` is a :class:`Deployment` that then builds the enabled
interceptors/observers, loads the family's components once, and the scheduler. Pipelines are built
lazily per task and cached. ``prepare(request)`` validates the request completely (task, limits,
node and plugin params, the family's own checks) and returns an
:class:`~omniloop.execution.Execution` for a scheduler to drive.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from . import limits as _limits
from . import linears as _linears
from . import placement as _placement
from . import rl as _rl
from . import weights as _weights
from .capabilities import FamilyCapabilities, capabilities_of
from .deploy import DeployConfig, load_deploy
from .errors import DeployError, PluginError, RequestError
from .execution import BuiltPipeline, Execution
from .family import LoadedModel, Mechanism, MechanismSpec, PluginComponentSpec, RuntimeLoaderSpec
from .graph import PipelineSpec
from .observers import ObserverBus
from .plugins import PluginManager, Registry, default_manager
from .request import EventKind, OmniEvent, OmniOutput, OmniRequest, Status, TaskType
from .resolved import GenericResolved, Resolved, bounds, check_limits
from .schema import as_request, structure_params
from .streams import final_output

log = logging.getLogger("omniloop")

#: the deploy's default ``attention_backend``: see :func:`resolve_auto_attention`
AUTO_ATTENTION = "auto"


def resolve_auto_attention(registry: Registry, deploy: DeployConfig, family: str) -> tuple[Any, str]:
    """``attention_backend: auto``: ``(spec, why)``. Of the registered backends with
    ``auto_rank > 0`` that are exact-class (not ``distribution_altering``), take no options,
    report ``available()`` and accept the deploy and family (``auto_accepts``), the highest rank wins (ties:
    the first name); with none, the core ``sdpa``. No timing happens here: a backend's rank is its
    author's claim, backed by a recorded measurement (omniloop-attention's README)."""
    candidates = []
    skipped = []
    for spec in registry.attention_backends.values():
        if spec.auto_rank <= 0 or spec.distribution_altering or spec.options_schema is not None:
            continue
        reason = spec.available() or (spec.auto_accepts(deploy, family) if spec.auto_accepts is not None else None)
        if reason:
            skipped.append(f"{spec.name}: {reason}")
            continue
        candidates.append(spec)
    if candidates:
        best = sorted(candidates, key=lambda s: (-s.auto_rank, s.name))[0]
        return best, f"rank {best.auto_rank}, available here"
    fallback = registry.attention_backends.get("sdpa")
    if fallback is None:
        raise DeployError("attention_backend: auto found no backend: not even the core 'sdpa' is registered")
    return fallback, "; ".join(skipped) or "no other backend declares itself for auto"

#: deploy fields a single-process :class:`Runtime` does not serve -> the package whose runtime loader
#: (``omniloop_register_runtime_loaders``) does; the core imports none of them
ROUTED = {"pipeline": "omniloop-compose", "models": "omniloop-compose",
          "parallel": "omniloop-parallel", "placement": "omniloop-parallel"}


def _repo_id_hint(given: str) -> str:
    """For a missing ``model.path`` that reads as a Hugging Face repo id (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``):
    how to get the folder, since omniloop loads local folders and never downloads (issue 42, finding 7)."""
    parts = given.split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][\w.-]*", p) for p in parts):
        return ""
    return (f"; {given!r} looks like a Hugging Face repo id: omniloop loads local folders and downloads nothing. "
            f"On a machine with internet access: huggingface-cli download {given} --local-dir /models/{parts[1]}, "
            f"then --model /models/{parts[1]} (docs/using-real-weights.md)")


def routed_fields(deploy: DeployConfig) -> list[str]:
    """The fields of ``deploy`` (in :data:`ROUTED`) that a single-process runtime does not serve."""
    on = {"pipeline": deploy.pipeline is not None, "models": bool(deploy.models),
          "parallel": deploy.parallel.world_size > 1, "placement": bool(deploy.placement)}
    return [name for name, set_ in on.items() if set_]


def loader_for(registry: Registry, deploy: DeployConfig) -> RuntimeLoaderSpec | None:
    """The registered runtime loader that claims ``deploy`` (None: a single-process deploy). A
    deploy that needs one that is not installed, or that two claim, is one :class:`DeployError`."""
    fields = routed_fields(deploy)
    if not fields:
        return None
    hits = [spec for spec in registry.runtime_loaders.values() if spec.claims(deploy)]
    if len(hits) > 1:
        raise DeployError(f"{fields[0]}: several runtime loaders claim this deploy "
                          f"({', '.join(sorted(h.name for h in hits))}); uninstall one")
    if not hits:
        what = f"parallel: {{sp: {deploy.parallel.sp}, cfg: {deploy.parallel.cfg}}}" if fields[0] == "parallel" else fields[0]
        raise DeployError(f"{what}: no installed runtime loader runs this deploy: pip install {ROUTED[fields[0]]}")
    return hits[0]


#: deploy fields served by a load-time mechanism a plugin registers (``omniloop_register_mechanisms``)
#: -> the package that serves it; the core imports none of them
MECHANISMS = {"adapters": "omniloop-adapters", "offload": "omniloop-offload", "weights": "omniloop-rl"}


def mechanism_fields(deploy: DeployConfig) -> list[str]:
    """The fields of ``deploy`` (in :data:`MECHANISMS`) that it sets."""
    on = {"adapters": bool(deploy.adapters or deploy.adapter_fuse), "offload": deploy.offload != "none"}
    return [name for name, set_ in on.items() if set_]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: tasks whose requests are conditioned on text: they need a non-blank prompt
TEXT_TASKS = frozenset({TaskType.T2V, TaskType.T2I, TaskType.T2A, TaskType.TTS})
#: denoising tasks: they read ``diffusion``, never the token-sampling knobs of ``sampling``
DIFFUSION_TASKS = frozenset({TaskType.T2V, TaskType.I2V, TaskType.V2V, TaskType.T2I, TaskType.I2I, TaskType.T2A})


class Deployment:
    """A deployment resolved without loading weights; :meth:`check` validates requests against it.

    Construction raises :class:`DeployError`/:class:`PluginError` for what :class:`Runtime` would
    refuse before loading (unknown preset, family, backend, scheduler or plugin, a bad plugin
    config, a device this machine lacks). Nothing a plugin factory or a family's ``load`` does runs.
    """

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                 manager: PluginManager | None = None) -> None:
        deploy = load_deploy(deploy)
        _refuse_unimplemented(deploy)
        self.deploy = deploy
        self.plugins = manager or default_manager()
        self.registry: Registry = self.plugins.registry()
        #: the runtime loader of a parallel / placement deploy (None: one process)
        self.loader = loader_for(self.registry, deploy)
        _placement.check_transport(deploy, self.registry)  # a registered transport that fits the deploy
        self.device = _device(deploy.device)
        self.dtype = _DTYPES[deploy.dtype]
        self.family, self.model_path = self._resolve_model()
        #: the preset's offered LoRA adapters that joined the deploy's ``adapters`` (ModelPreset.adapters)
        self.offered_adapters, fuse = self._offered_adapters(deploy)
        if self.offered_adapters:
            deploy = attrs.evolve(deploy, adapters={**self.offered_adapters, **deploy.adapters},
                                  adapter_fuse=fuse or deploy.adapter_fuse)
            self.deploy = deploy
        #: what the family declares it can do (checked when it registered)
        self.capabilities: FamilyCapabilities = capabilities_of(self.family)
        #: the checkpoint's declared range (its omniloop.json ``limits``; omniloop.limits), else what
        #: the family reads from its configs (``capabilities.checkpoint_limits``: a real checkpoint's
        #: trained size, a ``warn`` declaration), or None
        self.model_limits = _limits.declared(self.model_path)
        if self.model_limits is None and self.capabilities.checkpoint_limits is not None:
            self.model_limits = self.capabilities.checkpoint_limits(self.model_path)
        #: the tasks the checkpoint's omniloop.json declares (None: not declared)
        self.declared_tasks = _limits.declared_tasks(self.model_path)
        #: the deploy file's own limits; ``self.deploy.limits`` are the effective ones: these,
        #: tightened by a ``refuse`` declaration of the checkpoint (what every check reads)
        self.deploy_limits = deploy.limits
        deploy = attrs.evolve(deploy, limits=_limits.tighten(deploy.limits, self.model_limits))
        self.deploy = deploy
        self.attention = self._resolve_attention()
        #: the deploy's linear_precision (None: the dtype itself; else a plugin's spec, checked here)
        self.linear_precision = _linears.resolve(self)
        #: enabled interceptors/observers: name -> (spec, validated deploy config)
        self.component_configs: dict[str, tuple[PluginComponentSpec, Any]] = self._component_configs()
        self._scheduler_spec = self._scheduler_spec_of()
        family_options = {**self.preset_options, **deploy.options}
        #: the rollout the family options choose (options.rollout; checked against the declaration)
        self.rollout = self.capabilities.rollout(self.family.name, family_options)
        self.capabilities.check_options(self.family.name, deploy.options)  # a key it does not read: refused
        #: the load-time mechanisms plugins registered (LoRA adapters, offload), in install order, and
        #: (a Runtime) those installed, by deploy field
        self.mechanism_specs: list[MechanismSpec] = sorted(self.registry.mechanisms.values(), key=lambda s: (s.order, s.name))
        self.mechanisms: dict[str, Mechanism] = {}
        missing = [f for f in mechanism_fields(deploy) if f not in self.registry.mechanisms]
        if missing:
            raise DeployError(f"{missing[0]}: no installed plugin serves this field: pip install {MECHANISMS[missing[0]]}")
        for mechanism in self.mechanism_specs:
            if mechanism.check is not None:
                mechanism.check(self)
        _placement.check_attention_grid(deploy, self.family, self.attention, family_options)
        blocks = tuple(n for n, (s, _) in self.component_configs.items() if s.kind == "block_interceptor")
        if blocks and not self.capabilities.block_interceptors:
            raise DeployError(
                f"plugins.{blocks[0]}: block interceptor {blocks[0]!r} needs a family that runs its blocks through "
                f"run_blocks; family {self.family.name!r} does not"
            )
        if self.loader is not None and self.loader.check is not None:  # parallel: {sp, cfg}; placement
            self.loader.check(self, blocks)
        self.options: dict[str, Any] = {
            "deploy": deploy, "registry": self.registry, "attention": self.attention,
            **self.preset_options, **deploy.options,
        }
        self._inspected: LoadedModel | bool | None = False  # False: not asked yet

    # -- what the checkpoint can do, without its weights ---------------------------------------
    def inspect(self) -> LoadedModel | None:
        """The family's config-only view of the checkpoint (``family.inspect``), or None when the
        family offers none. It has no components; families use it for checks that need no weights."""
        if self._inspected is False:
            self._inspected = (self.family.inspect(self.model_path, options=self.options)
                               if self.capabilities.inspect else None)
        return self._inspected if isinstance(self._inspected, LoadedModel) else None

    @property
    def supported_tasks(self) -> frozenset[TaskType]:
        """The tasks the checkpoint supports, as far as is known without loading it."""
        model = self.inspect()
        if model is not None:
            return _tasks_of(self.family, model)
        family_tasks = frozenset(self.family.tasks)
        if self.declared_tasks is not None:  # the checkpoint's omniloop.json says (omniloop.limits)
            return frozenset(t for t in family_tasks if t.value in self.declared_tasks)
        return family_tasks

    def check(self, request: OmniRequest | Mapping[str, Any]) -> OmniRequest:
        """Every check of ``request`` that needs no weights; returns the validated request.

        Raises :class:`RequestError` naming the field. :meth:`Runtime.prepare` re-runs these and
        adds the checks that need the loaded model (node params, the family's full checks)."""
        req = as_request(request)  # a Python-built OmniRequest meets the converter's rules too
        model = self.inspect()
        self._check_task(req, model)
        self._check_common(req)
        self._check_plugin_params(req)
        self._check_mechanisms(req)
        spec = self._config_pipeline(model, req.task) if model is not None else None
        if model is not None and spec is not None and self.capabilities.resolve:
            bounded = self._resolve(model, req, structure_node_params(spec, req)).workload().bounded
        else:  # without the model's config, the request's own values are what can be bounded
            if model is not None:
                self.family.validate_request(model, req, self.deploy.limits)
            d = req.diffusion
            bounded = bounds(steps=d.steps, frames=d.frames, height=d.height, width=d.width)
        self._check_limits(bounded)
        return req

    def _check_mechanisms(self, req: OmniRequest) -> None:
        for mechanism in self.mechanism_specs:
            if mechanism.check_request is not None:
                mechanism.check_request(self, req)
        if req.adapters and "adapters" not in self.registry.mechanisms:
            raise RequestError("adapters.0.name", f"unknown adapter {req.adapters[0].name!r} (this deployment "
                               f"declares: none; LoRA adapters need {MECHANISMS['adapters']})")

    @property
    def limits(self) -> Any:
        """The limits requests are checked against, once, after resolve: the deploy's ``limits``
        tightened by the checkpoint's ``refuse`` declaration (``omniloop.limits``)."""
        return self.deploy.limits

    def _config_pipeline(self, model: LoadedModel, task: TaskType) -> PipelineSpec | None:
        """The pipeline spec built on a config-only model (its node param schemas), or None when the
        family needs loaded components to build it."""
        try:
            spec: PipelineSpec = self.family.build_pipeline(model, task, self.options)
        except (KeyError, AttributeError, TypeError):
            return None
        return spec

    def _resolve(self, model: LoadedModel, req: OmniRequest, node_params: Mapping[str, Any]) -> Resolved:
        """The family's resolved form of ``req`` (``family.resolve``), or the core's generic one."""
        if self.capabilities.resolve:
            resolved = self.family.resolve(model, req, self.deploy.limits, node_params=node_params)
            if not isinstance(resolved, Resolved):
                raise PluginError(
                    f"family {self.family.name!r}: resolve() returned {type(resolved).__name__}, which lacks "
                    "task, warnings or workload() (omniloop.resolved.Resolved)"
                )
            return resolved
        warnings = tuple(self.family.validate_request(model, req, self.deploy.limits) or ())
        return GenericResolved(task=req.task, warnings=warnings, node_params=dict(node_params),
                               defaults=_defaults_of(self.family, model, req.task), request=req)

    def _check_task(self, req: OmniRequest, model: LoadedModel | None) -> None:
        tasks = self.supported_tasks
        if req.task in tasks:
            return
        have = ", ".join(sorted(t.value for t in tasks))
        if req.task in self.family.tasks:  # the family can, this checkpoint cannot: let it say why
            if model is not None:
                self.family.validate_request(model, req, self.deploy.limits)
            raise RequestError("task", f"{req.task.value!r} is not supported by the checkpoint at {self.model_path} (supported: {have})")
        raise RequestError("task", f"{req.task.value!r} is not supported by family {self.family.name!r} (supported: {have})")

    def _check_common(self, req: OmniRequest) -> None:
        self._check_outputs(req)
        if req.task in DIFFUSION_TASKS:  # token-sampling knobs a denoising request would ignore
            given = _non_default_fields(req.sampling)
            if given:
                raise RequestError(
                    f"sampling.{given[0]}", f"a {req.task.value} request does not read sampling parameters "
                    "(they tune token generation: task reason); remove it")
        if req.task in TEXT_TASKS:
            prompt = req.prompt
            if prompt is None or not prompt.strip():
                raise RequestError("inputs", f"a {req.task.value} request needs a non-empty prompt (a text part with role 'prompt')")
        if req.exact and self.attention.distribution_altering:
            raise RequestError("exact", f"attention backend {self.attention.name!r} alters outputs; exact requests cannot use it")
        _linears.check_request(req, self.linear_precision)
        if req.audio is not None and not self.capabilities.makes_audio(req.task):  # nothing silently ignored
            raise RequestError("audio", f"family {self.family.name!r} does not make audio for a {req.task.value} "
                               "request (its capabilities declare none for it); remove audio")
        knobs = req.audio.guidance_knobs() if req.audio is not None else []
        if knobs and not self.capabilities.audio_guidance:
            raise RequestError(f"audio.{knobs[0]}", f"family {self.family.name!r} has no separate audio guidance "
                               "(only a joint audio-video model such as ltx2 reads it); remove it")
        if req.action is not None and not self.capabilities.actions:
            raise RequestError("action", f"family {self.family.name!r} takes no action-conditioned requests; remove action")
        if req.audio is not None and req.audio.enabled is False and req.task is TaskType.T2A:
            raise RequestError("audio.enabled", "a t2a request always makes audio; remove audio.enabled: false")
        self._check_group_and_rollout(req)

    def _check_group_and_rollout(self, req: OmniRequest) -> None:
        """``diffusion.num_outputs`` and ``rollout``: the checks that need no weights."""
        k = req.diffusion.num_outputs
        if k is not None and k > 1:
            if req.task is TaskType.REASON:
                raise RequestError("diffusion.num_outputs", "applies to diffusion tasks; a reason request makes one output")
            seed = req.diffusion.seed
            if seed is not None and seed + k - 1 > 2**63 - 1:
                raise RequestError("diffusion.num_outputs", f"seeds seed + i overflow 64 bits for seed {seed} and {k} outputs")
        if req.rollout is None:
            return
        if _rl.family_rollout_support(self.family) is None:
            raise RequestError("rollout", f"family {self.family.name!r} cannot run rollouts (its loop is not a "
                               "flow-matching denoise loop that declares capabilities.rollout_support)")
        if req.rollout.kind == "ode" and req.rollout.sde_steps:
            raise RequestError("rollout.sde_steps", "an ode rollout takes no stochastic steps; drop sde_steps or use kind sde/cps")

    @property
    def model_name(self) -> str:
        """How messages name the model: ``'wan-demo'`` (a preset) or its path."""
        return repr(self.deploy.model.preset) if self.deploy.model.preset else str(self.model_path)

    def limit_warnings(self, req: OmniRequest) -> list[str]:
        """One warning per field of ``req`` outside a ``warn`` declaration of the checkpoint
        (:mod:`omniloop.limits`; a ``refuse`` declaration is enforced by the range check)."""
        m = self.model_limits
        if m is None or m.enforce != "warn":
            return []
        d = req.diffusion
        values = {"steps": d.steps, "frames": d.frames, "height": d.height, "width": d.width}
        return [f"{path}: {msg}; it runs (bounded by the deployment's limits) but may degrade"
                for path, msg in _limits.outside(m, values, self.model_name)]

    def _check_limits(self, bounded: Mapping[str, tuple[int, str]]) -> None:
        """The one range check of a request, after resolve, on what resolved (``Workload.bounded``:
        each value with the request field it came from): the checkpoint's declared range when it
        refuses (``omniloop.limits``, named as the model's), then the effective deploy limits."""
        m = self.model_limits
        if m is not None and m.enforce == "refuse":  # the model's own range, named as such
            for name, (value, path) in bounded.items():
                for _, msg in _limits.outside(m, {name: value}, self.model_name):
                    raise RequestError(path, msg)
        check_limits(bounded, self.limits)

    def _check_outputs(self, req: OmniRequest) -> None:
        """Outputs the family (under its chosen rollout) does not produce are refused, not dropped."""
        if req.outputs.return_latents and not self.rollout.returns_latents:
            how = f" under options.rollout: {self.rollout.name}" if self.capabilities.rollouts else ""
            raise RequestError("outputs.return_latents",
                               f"family {self.family.name!r}{how} does not return latents; leave it false")
        if req.outputs.stream_partial and not self.rollout.streams:
            how = f" under options.rollout: {self.rollout.name}" if self.capabilities.rollouts else ""
            raise RequestError("outputs.stream_partial",
                               f"family {self.family.name!r}{how} emits no partial outputs; leave it false")

    def _check_plugin_params(self, req: OmniRequest) -> dict[str, Any]:
        params: dict[str, Any] = {}
        enabled = self.component_configs
        for name, p in req.plugin_params.items():
            if name not in enabled:
                names = ", ".join(sorted(enabled)) or "none"
                raise RequestError(f"plugin_params.{name}", f"plugin {name!r} is not enabled in this deployment (enabled: {names})")
            spec, _ = enabled[name]
            if req.exact and spec.distribution_altering:
                raise RequestError(f"plugin_params.{name}", f"plugin {name!r} alters outputs; an exact request cannot tune it")
            if spec.params_schema is None:
                if p:
                    raise RequestError(f"plugin_params.{name}", f"plugin {name!r} takes no request parameters")
                continue
            params[name] = structure_params(spec.params_schema, p, f"plugin_params.{name}")
        for name, (spec, _) in enabled.items():  # defaults for the untuned
            if name not in params and spec.params_schema is not None:
                params[name] = structure_params(spec.params_schema, {}, f"plugin_params.{name}")
        return params

    def _resolve_model(self) -> tuple[Any, Path]:
        m = self.deploy.model
        reg = self.registry
        #: family options of the preset (under the deploy's own options)
        self.preset_options: dict[str, Any] = {}
        if m.preset:
            preset = reg.presets.get(m.preset)
            if preset is None:
                self.plugins.require(m.preset, "model preset")
                known = ", ".join(sorted(reg.presets)) or "none installed"
                raise DeployError(f"model: unknown model preset {m.preset!r} (known presets: {known})")
            family_name = m.family or preset.family
            path = Path(preset.path())
            self.preset_options = dict(preset.options)
        elif m.path:
            path = Path(m.path).expanduser()
            if not path.exists():
                raise DeployError(f"model.path: {path} does not exist{_repo_id_hint(m.path)}")
            family_name = m.family or self._detect_family(path)
        else:
            raise DeployError("model: give a preset name or a checkpoint path")
        family = reg.families.get(family_name)
        if family is None:
            self.plugins.require(family_name, "model family")
            known = ", ".join(sorted(reg.families)) or "none installed"
            raise DeployError(f"model.family: unknown model family {family_name!r} (installed families: {known})")
        return family, path

    def _offered_adapters(self, deploy: DeployConfig) -> tuple[dict[str, str], dict[str, float]]:
        """The preset's adapters (``ModelPreset.adapters``), when the adapters mechanism is
        installed and the deploy leaves adapters free: none fused, no offload, the dtype's linears, no
        CUDA-graph compile (what the mechanism would refuse with adapters); a file not installed is
        not offered. The deploy's own adapters win a name clash. Returns ``(adapters, adapter_fuse)``."""
        preset = self.registry.presets.get(deploy.model.preset) if deploy.model.preset else None
        if preset is None or not preset.adapters:
            return {}, {}
        if preset.adapter_fuse:  # the model is base + this adapter: required
            if "adapters" not in self.registry.mechanisms:
                raise DeployError(f"model: {preset.name!r} is its base with the LoRA adapter(s) "
                                  f"{', '.join(preset.adapter_fuse)} fused at load: pip install {MECHANISMS['adapters']}")
            if deploy.adapters or deploy.adapter_fuse:
                raise DeployError(f"adapters: model {preset.name!r} fuses its own adapter "
                                  f"({', '.join(preset.adapter_fuse)}); it takes no other adapters")
            return {name: str(path()) for name, path in preset.adapters.items()}, dict(preset.adapter_fuse)
        if "adapters" not in self.registry.mechanisms:
            return {}, {}
        mode = {**self.preset_options, **deploy.options}.get("compile_mode")
        if (deploy.adapter_fuse or deploy.offload != "none" or deploy.linear_precision != "dtype"
                or (deploy.compile and mode in ("reduce-overhead", "max-autotune"))):
            return {}, {}
        paths = {name: Path(path()) for name, path in preset.adapters.items() if name not in deploy.adapters}
        return {name: str(p) for name, p in paths.items() if p.exists()}, {}

    def _detect_family(self, path: Path) -> str:
        hits = [name for name, fam in self.registry.families.items() if _safe_detect(fam, path)]
        if not hits:
            known = ", ".join(sorted(self.registry.families)) or "none installed"
            raise DeployError(
                f"model.path: no installed family recognizes the checkpoint at {path} (installed families: {known})"
            )
        if len(hits) > 1:
            raise DeployError(f"model.path: several families recognize {path} ({', '.join(hits)}); set model.family")
        return hits[0]

    def _resolve_attention(self) -> Any:
        name = self.deploy.attention_backend
        if name == AUTO_ATTENTION:
            if self.deploy.attention_options:
                raise DeployError(f"attention_options: given for attention_backend: auto, which picks a backend per "
                                  f"machine and passes it no options; name the backend they are for "
                                  f"(got {sorted(self.deploy.attention_options)})")
            spec, why = resolve_auto_attention(self.registry, self.deploy, self.family.name)
            log.info("attention_backend: auto -> %s (%s)", spec.name, why)
            return spec
        spec = self.registry.attention_backends.get(name)
        if spec is None:
            self.plugins.require(name, "attention backend")
            known = ", ".join(sorted(self.registry.attention_backends))
            raise DeployError(f"attention_backend: unknown backend {name!r} (available: {known})")
        reason = spec.available()
        if reason:
            raise DeployError(f"attention_backend: {name!r} cannot run here: {reason}")
        options = self.deploy.attention_options
        if spec.options_schema is None:
            if options:
                raise DeployError(f"attention_options: backend {name!r} takes no options, got {sorted(options)}")
            return spec
        try:
            config: Any = structure_params(spec.options_schema, options, "attention_options")
            fn = spec.configure(config) if spec.configure is not None else spec.fn
        except RequestError as exc:
            raise DeployError(f"deploy config: {exc}") from None
        except ValueError as exc:
            raise DeployError(str(exc)) from None
        return attrs.evolve(spec, fn=fn)

    def _component_configs(self) -> dict[str, tuple[PluginComponentSpec, Any]]:
        out: dict[str, tuple[PluginComponentSpec, Any]] = {}
        for name, conf in self.deploy.plugins.items():
            spec = self.registry.component(name)
            if spec is None:
                self.plugins.require(name, "plugin")
                known = ", ".join(sorted([*self.registry.interceptors, *self.registry.observers])) or "none installed"
                raise DeployError(f"plugins.{name}: no installed interceptor or observer is named {name!r} (available: {known})")
            config: Any = None
            if spec.config_schema is not None:
                try:
                    config = structure_params(spec.config_schema, conf, f"plugins.{name}")
                except RequestError as exc:
                    raise DeployError(f"deploy config: {exc}") from None
            elif conf:
                raise DeployError(f"plugins.{name}: this plugin takes no options, got {sorted(conf)}")
            out[name] = (spec, config)
        blocks = [n for n, (s, _) in out.items() if s.kind == "block_interceptor"]
        if len(blocks) > 1:
            raise DeployError(
                f"plugins: two block interceptors are enabled ({', '.join(blocks)}); a loop runs its blocks through one"
            )
        return out

    def _scheduler_spec_of(self) -> Any:
        name = self.deploy.scheduler
        spec = self.registry.schedulers.get(name)
        if spec is None:
            self.plugins.require(name, "scheduler")
            known = ", ".join(sorted(self.registry.schedulers)) or "none installed"
            hint = " (pip install omniloop-scheduler)" if not self.registry.schedulers else ""
            raise DeployError(f"scheduler: unknown scheduler {name!r} (available: {known}){hint}")
        return spec


def deploy_for_model(model: str | os.PathLike[str], device: str = "cpu", dtype: str = "float32", **deploy: Any) -> DeployConfig:
    """The deploy config :meth:`Runtime.from_model` uses: a preset name or a checkpoint path."""
    s = str(model)
    looks_like_path = os.sep in s or s.startswith(".") or Path(s).exists()
    model_cfg = {"path": s} if looks_like_path else {"preset": s}
    if "family" in deploy:
        model_cfg["family"] = deploy.pop("family")
    return load_deploy({"model": model_cfg, "device": device, "dtype": dtype, **deploy})


def check_request(
    deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], request: OmniRequest | Mapping[str, Any],
    *, manager: PluginManager | None = None,
) -> OmniRequest:
    """Validate ``request`` against ``deploy`` without loading any weights (see :meth:`Deployment.check`;
    a composed deploy: its runtime loader's weight-free view)."""
    cfg = load_deploy(deploy)
    manager = manager or default_manager()
    loader = loader_for(manager.registry(), cfg)
    if loader is not None and loader.deployment is not None:
        checked: OmniRequest = loader.deployment(cfg, manager=manager).check(request)
        return checked
    return Deployment(cfg, manager=manager).check(request)


class Runtime(Deployment):
    """A loaded deployment. Thread-compatible: drive it from one scheduler."""

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                 manager: PluginManager | None = None) -> None:
        super().__init__(deploy, manager=manager)
        if self.loader is not None:  # e.g. parallel: only inside omniloop-parallel's pool, never silently here
            if self.loader.check_direct is None:
                raise DeployError(f"{routed_fields(self.deploy)[0]}: load this deploy with Runtime.from_deploy "
                                  f"({self.loader.name!r} runtime loader), not a plain Runtime")
            self.loader.check_direct(self.deploy)
        self.components_enabled = self._build_components()
        self.scheduler = self._resolve_scheduler()
        storage = self.device  # offload: the weights load into host memory
        for mechanism in self.mechanism_specs:
            storage = mechanism.storage_device(self.deploy, storage) if mechanism.storage_device else storage
        self.model: LoadedModel = self.family.load(self.model_path, device=storage, dtype=self.dtype, options=self.options)
        #: linear_precision: fp8 — the denoiser blocks' linears swapped for e4m3 GEMMs (None: dtype)
        self.linears = _linears.apply(self.linear_precision, self.model, self.family, self.deploy)
        self._pipelines: dict[TaskType, BuiltPipeline] = {}
        for mechanism in self.mechanism_specs:  # offload installed, LoRA adapters read and hooked
            installed = mechanism.install(self) if mechanism.install is not None else None
            if installed is not None:
                self.mechanisms[mechanism.name] = installed
        #: the weights' version (``update_weights``); every output's ``metrics["weight_version"]``
        self.weight_version: str = self.model.weight_version or "initial"
        self._runs_lock = threading.RLock()  # held around every unit; updates apply under it
        self._running: set[int] = set()  # executions started and not finished
        self._runs_cond = threading.Condition(threading.Lock())
        self._sleeper = _weights.Sleeper()

    @property
    def adapters(self) -> Any:
        """The LoRA adapters' bank (omniloop-adapters' ``AdapterBank``), or None."""
        return self.mechanisms.get("adapters")

    @property
    def offload(self) -> Any:
        """The ``offload: model | sequential`` offloader (omniloop-offload's ``Offloader``), or None."""
        return self.mechanisms.get("offload")

    @offload.setter
    def offload(self, value: Any) -> None:
        self.mechanisms.pop("offload", None)
        if value is not None:
            self.mechanisms["offload"] = value

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_deploy(
        cls, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
        manager: PluginManager | str | None = None,
    ) -> Runtime:
        """The runtime of ``deploy``: a single-process :class:`Runtime`, or what the runtime loader a
        plugin registered for it builds (:data:`ROUTED`: omniloop-compose's composed pipelines,
        omniloop-parallel's worker pools). Every front end loads through here. ``manager``: a
        PluginManager, None (the installed plugins) or a ``"module:function"`` spec returning one
        (handed as is to the loader, whose worker processes re-create it)."""
        cfg = load_deploy(deploy)
        routing = _manager_of(manager)
        loader = loader_for(routing.registry(), cfg)
        if loader is not None:  # given the manager as passed: a "module:function" spec is for its workers
            return loader.load(cfg, manager=manager)  # type: ignore[no-any-return]
        return cls(cfg, manager=routing)

    @classmethod
    def from_model(
        cls, model: str | os.PathLike[str], device: str = "cpu", dtype: str = "float32",
        *, manager: PluginManager | None = None, **deploy: Any,
    ) -> Runtime:
        """A runtime for a preset name (``wan-demo``) or a checkpoint path.

        ``deploy`` takes any other DeployConfig field (``plugins={...}``, ``limits={...}``);
        ``manager`` is the PluginManager to use (default: the installed entry points).
        """
        return cls(deploy_for_model(model, device, dtype, **deploy), manager=manager)

    def _build_components(self) -> dict[str, tuple[PluginComponentSpec, Any]]:
        built: dict[str, tuple[PluginComponentSpec, Any]] = {}
        for name, (spec, config) in self.component_configs.items():
            try:
                obj = spec.factory(config)
            except Exception as exc:
                raise PluginError(f"plugins.{name}: could not be created: {type(exc).__name__}: {exc}") from exc
            built[name] = (spec, obj)
        return built

    def _resolve_scheduler(self) -> Any:
        spec = self._scheduler_spec
        return spec.factory(self, **self.deploy.scheduler_options) if _takes_runtime(spec.factory) else spec.factory()

    # -- pipelines ------------------------------------------------------------------------------
    def inspect(self) -> LoadedModel:
        """The loaded model (a runtime needs no config-only view)."""
        return self.model

    @property
    def supported_tasks(self) -> frozenset[TaskType]:
        """The tasks the loaded checkpoint can actually do (a T2V checkpoint of a family that also
        does I2V lists only ``t2v``): the family's ``supported_tasks(model)`` when it has one,
        else what the loaded model declares (``LoadedModel.tasks``, ``config["tasks"]``), else
        the family's ``tasks``. Front ends advertise this, not ``family.tasks``."""
        return _tasks_of(self.family, self.model)

    @property
    def tasks(self) -> frozenset[TaskType]:
        """Same as :attr:`supported_tasks` (the older name)."""
        return self.supported_tasks

    def defaults(self, task: TaskType | str) -> dict[str, Any]:
        """The defaults a request of ``task`` gets for fields it leaves unset (steps, size, frames, fps, ...)."""
        return _defaults_of(self.family, self.model, TaskType(task))

    def pipeline(self, task: TaskType) -> BuiltPipeline:
        built = self._pipelines.get(task)
        if built is None:
            built = self._build(task)
            self._pipelines[task] = built
        return built

    def _build(self, task: TaskType) -> BuiltPipeline:
        spec: PipelineSpec = self.family.build_pipeline(self.model, task, self.options)
        for mechanism in self.mechanisms.values():
            spec = mechanism.wrap_pipeline(spec)
        observers = [(n, obj) for n, (s, obj) in self.components_enabled.items() if s.kind == "observer"]
        bus = ObserverBus(observers) if observers else None
        block = [obj for s, obj in self.components_enabled.values() if s.kind == "block_interceptor"]
        step = tuple(obj for s, obj in self.components_enabled.values() if s.kind == "step_interceptor")
        interceptors = [*block, *step]
        eager = any(getattr(i, "needs_eager", False) for i in interceptors) or bool(bus and bus.needs_eager)
        if eager:
            why = [getattr(i, "name", "?") for i in interceptors if getattr(i, "needs_eager", False)]
            if bus is not None and bus.needs_eager:
                why += [n for n, o in observers if getattr(o, "needs_eager", False)]
            log.info("eager execution forced by: %s", ", ".join(why))
        return BuiltPipeline(
            spec=spec, components=self.model.components, device=self.device, dtype=self.dtype, bus=bus,
            block_interceptor=block[0] if block else None, step_interceptors=step, eager=eager,
            options=self.options, model_name=self.deploy.model.preset or str(self.model_path),
        )

    # -- requests -------------------------------------------------------------------------------
    def prepare(self, request: OmniRequest | Mapping[str, Any], *, _initial_seed: int | None = None,
                _rollout_seed: int | None = None, _replay: torch.Tensor | None = None) -> Execution:
        """Validate ``request`` completely (before any compute) and return its execution.

        A request with ``diffusion.num_outputs`` > 1 is a group: :meth:`prepare_group` (or
        :meth:`generate` / :meth:`stream`, which run the group)."""
        req = as_request(request)  # a Python-built OmniRequest meets the converter's rules too
        if self._sleeper.asleep:
            raise _weights.RuntimeAsleep("the runtime is asleep (Runtime.sleep): wake() it before running requests")
        if (req.diffusion.num_outputs or 1) > 1:
            raise RequestError("diffusion.num_outputs", f"{req.diffusion.num_outputs} outputs make a group of executions: "
                               "use Runtime.prepare_group, generate or stream")
        self._check_task(req, self.model)
        self._check_common(req)
        built = self.pipeline(req.task)
        node_params = structure_node_params(built.spec, req)
        plugin_params = self._check_plugin_params(req)
        self._check_mechanisms(req)
        active = [i for i in built.interceptors if not (req.exact and getattr(i, "distribution_altering", False))]
        resolved = self._resolve(self.model, req, node_params)  # the one resolution of this request
        self._check_limits(resolved.workload().bounded)  # the one range check, on what resolved
        support = self._check_rollout(req, built, resolved, active) if req.rollout is not None else None
        scopes = tuple(s for m in self.mechanisms.values() if (s := m.request_scope(req)) is not None)
        warnings = (*resolved.warnings, *self.limit_warnings(req))
        return Execution(built, req, node_params=node_params, plugin_params=plugin_params, warnings=warnings,
                         resolved=resolved, active_interceptors=active, scopes=scopes, rollout_support=support,
                         weight_version=self.weight_version, initial_seed=_initial_seed, rollout_seed=_rollout_seed,
                         replay=_replay, lifecycle=self,
                         retry_alone=self.capabilities.step_batch_retry_alone)

    def _check_rollout(self, req: OmniRequest, built: BuiltPipeline, resolved: Resolved,
                       active: list[Any]) -> _rl.RolloutSupport:
        support = _rl.family_rollout_support(self.family)
        assert support is not None and req.rollout is not None  # _check_common refused the rest
        loops = [n.name for n in built.spec.nodes if n.is_loop and n.name in support.nodes and n.runs_for(req)]
        if not loops:
            raise RequestError("rollout", f"the {req.task.value} pipeline of family {self.family.name!r} has no loop "
                               f"that runs rollout steps (rollout nodes: {', '.join(support.nodes)})")
        _rl.check_rollout(req.rollout, resolved.workload().steps)
        if "log_probs" in req.rollout.capture and req.rollout.kind != "ode" and not req.rollout.allow_cache:
            altering = [getattr(i, "name", "?") for i in active if getattr(i, "distribution_altering", False)]
            if altering:
                raise RequestError("rollout.allow_cache", f"interceptor {altering[0]!r} alters the computation, so the "
                                   "rollout's log-probs would not equal a trainer's recomputation (C1); set "
                                   "rollout.allow_cache: true to accept that, or disable the interceptor")
        return support

    def prepare_group(self, request: OmniRequest | Mapping[str, Any]) -> list[Execution]:
        """The executions of a request's ``diffusion.num_outputs`` samples: sample ``i`` is the
        request with seed ``seed + i`` (a random base seed when none is given), request id
        ``<id>_<i>`` and its own generator — diffusers' behaviour with a list of generators. With
        ``rollout.same_initial_noise`` every sample draws its initial noise from seed ``seed`` and
        its SDE noise from its own generator (:func:`omniloop.rl.noise_seed`)."""
        req = as_request(request)
        k = req.diffusion.num_outputs or 1
        if k == 1:
            return [self.prepare(attrs.evolve(req, diffusion=attrs.evolve(req.diffusion, num_outputs=None)))]
        self._check_common(req)
        base = req.diffusion.seed
        if base is None:
            base = int(torch.randint(0, 2**31 - 1, (1,)).item())
        same = req.rollout is not None and req.rollout.same_initial_noise
        out = []
        for i in range(k):
            ri = attrs.evolve(req, request_id=f"{req.request_id}_{i}",
                              diffusion=attrs.evolve(req.diffusion, seed=base + i, num_outputs=None))
            out.append(self.prepare(ri, _initial_seed=base if same else None,
                                    _rollout_seed=_rl.noise_seed(base, i) if same else None))
        return out

    def generate_replay(self, request: OmniRequest | Mapping[str, Any], trajectory: _rl.Trajectory) -> OmniOutput:
        """Run a rollout request again with ``trajectory``'s latents teacher-forced (each step a fresh
        forward on the recorded state); its output's trajectory holds the recomputed log-probs
        (:func:`omniloop_rl.trainer.replay_log_probs`)."""
        req = as_request(request)
        if req.rollout is None:
            raise RequestError("rollout", "a replay needs the rollout request that recorded the trajectory")
        execution = self.prepare(req, _replay=trajectory.latents)
        return final_output(self.scheduler.stream(execution))

    def resolve(self, request: OmniRequest | Mapping[str, Any]) -> Resolved:
        """``request`` validated and resolved by its family, without an execution (what
        :meth:`prepare` stores on ``Execution.resolved``; schedulers size requests with it)."""
        return self.prepare(request).resolved  # type: ignore[return-value]

    def generate(self, request: OmniRequest | Mapping[str, Any]) -> OmniOutput:
        """Run ``request`` to completion with the deploy's scheduler and return its output (for
        ``diffusion.num_outputs`` > 1: sample 0's artifacts, every sample in ``samples``)."""
        return final_output(self.stream(request))

    def stream(self, request: OmniRequest | Mapping[str, Any]) -> Iterator[OmniEvent]:
        """Validate, then run ``request``, yielding progress events and a final event."""
        req = as_request(request)
        if (req.diffusion.num_outputs or 1) > 1:
            return self._stream_group(req, self.prepare_group(req))
        execution = self.prepare(req)
        events: Iterator[OmniEvent] = self.scheduler.stream(execution)
        return events

    def _stream_group(self, req: OmniRequest, executions: list[Execution]) -> Iterator[OmniEvent]:
        """Every sample submitted first (the step scheduler co-batches them), then drained in order;
        one final event with the group's output."""
        streams = [self.scheduler.stream(ex) for ex in executions]
        outs: list[OmniOutput] = []
        for st in streams:
            for ev in st:
                if ev.kind is EventKind.FINAL and ev.output is not None:
                    outs.append(ev.output)
                else:
                    yield ev
        first_bad = next((o for o in outs if o.status is not Status.COMPLETED), None)
        metrics: dict[str, Any] = {"num_outputs": len(outs), "seeds": [o.metrics.get("seed") for o in outs],
                                   "weight_version": outs[0].metrics.get("weight_version") if outs else self.weight_version}
        group = OmniOutput(req.request_id, first_bad.status if first_bad else Status.COMPLETED,
                           artifacts=dict(outs[0].artifacts) if outs else {}, metrics=metrics,
                           error=first_bad.error if first_bad else None, samples=outs)
        yield OmniEvent(req.request_id, EventKind.FINAL, output=group)

    # -- executions in flight (update_weights, sleep wait for them) ----------------------------
    def on_start(self, execution: Execution) -> None:
        """Called by an execution before its first unit (the runtime's in-flight set); refuses to
        start one while the runtime is asleep (a request queued before ``sleep``)."""
        if self._sleeper.asleep:
            raise _weights.RuntimeAsleep("the runtime went to sleep (Runtime.sleep) before this request started")
        with self._runs_cond:
            self._running.add(id(execution))
        # the version it runs on is the one in place when it starts (an update waits for it)
        execution.weight_version = self.weight_version
        execution.state.metrics["weight_version"] = self.weight_version

    def unit(self) -> Any:
        """The lock an execution holds around each unit of work (updates apply between units)."""
        return self._runs_lock

    def on_finish(self, execution: Execution) -> None:
        with self._runs_cond:
            self._running.discard(id(execution))
            self._runs_cond.notify_all()

    @property
    def in_flight(self) -> int:
        """Requests that started and have not finished."""
        with self._runs_cond:
            return len(self._running)

    def _when_idle(self, fn: Any, timeout: float) -> Any:
        """Run ``fn`` with no request in flight: wait for the started ones to finish (driving the
        scheduler when it can be driven from here), then run it before any other request starts."""
        deadline = time.monotonic() + timeout
        drive = getattr(self.scheduler, "drive_once", None)
        while True:
            with self._runs_cond:
                idle = not self._running
            if idle:
                with self._runs_lock:  # no unit runs now; a request starting later sees the result
                    with self._runs_cond:
                        if not self._running:
                            return fn()
            if time.monotonic() > deadline:
                raise _weights.WeightUpdateError(
                    "timeout", f"{self.in_flight} request(s) still in flight after {timeout:g} s; nothing was changed")
            if not (callable(drive) and drive()):
                with self._runs_cond:
                    self._runs_cond.wait(0.05)

    # -- weights (post-training) ---------------------------------------------------------------
    def update_weights(self, source: Any, *, version: str, adapter: str | None = None,
                       timeout: float = 600.0, checksum: bool = True) -> str | None:
        """Replace the denoiser's weights (or register a LoRA adapter as ``adapter``) and set the
        weight version; returns the new :meth:`weights_checksum` (``mix128``, computed on the
        device), or None with ``checksum=False`` (nothing hashed; ask :meth:`weights_checksum` later).

        ``source``: a ``{name: tensor}`` mapping, a safetensors file or a folder of them
        (:mod:`omniloop_rl.weights` says which names). Atomic: read and checked completely first — a
        bad name, shape, dtype, non-finite value or unreadable file raises one
        :class:`~omniloop.weights.WeightUpdateError` naming the field and changes nothing. Applied at
        a step boundary: **the call waits** until every request in flight (started, not finished)
        has finished — they finish on the version they started with — and requests that start
        afterwards run on the new version (``metrics["weight_version"]``)."""
        version = _weights.check_version(version)
        if self._sleeper.asleep:
            raise _weights.WeightUpdateError("source", "the runtime is asleep; wake() it before updating weights")
        if self.deploy.adapter_fuse:
            raise _weights.WeightUpdateError("source", "this deployment fuses an adapter into the weights (adapter_fuse); "
                                             "updates would mix with it")
        if self.linears is not None:
            raise _weights.WeightUpdateError("source", "the denoiser's linears are converted (linear_precision); "
                                             "load the new weights in a fresh runtime")
        refusal = self.capabilities.weight_update_refusal
        why = refusal(self.options) if refusal is not None else None
        if why:
            raise _weights.WeightUpdateError("source", why)
        kind = "adapters" if adapter is not None else "weights"
        mechanism = self._mechanism(kind, "adapter" if adapter is not None else "source")
        assert mechanism.update is not None
        update = mechanism.update(self, adapter or "", source)  # read and checked now; applied between requests

        def apply() -> str | None:
            update()
            self.weight_version = version
            return self.weights_checksum() if checksum else None

        result: str | None = self._when_idle(apply, timeout)
        return result

    def weights_checksum(self, algorithm: str = "mix128") -> str:
        """Fingerprint of the denoiser's weights and the adapters registered by :meth:`update_weights`,
        ``"<algorithm>:<hex>"``: ``"mix128"`` (default) hashes each tensor on its own device and
        only combines 16-byte digests on the host; ``"sha256"`` hashes every byte on the host
        (cryptographic, seconds for a 1B-parameter denoiser). See :func:`omniloop_rl.weights.checksum`."""
        if algorithm not in _weights.CHECKSUM_ALGORITHMS:
            raise _weights.WeightUpdateError("algorithm", f"must be one of {', '.join(_weights.CHECKSUM_ALGORITHMS)}")
        if self._sleeper.asleep:
            raise _weights.RuntimeAsleep("the runtime is asleep: wake() it to read its weights")
        mechanism = self._mechanism("weights", "algorithm")
        assert mechanism.fingerprint is not None
        return mechanism.fingerprint(self, [item for m in self.mechanisms.values() for item in m.checksum_items()], algorithm)

    def _mechanism(self, name: str, field: str) -> MechanismSpec:
        """The registered mechanism ``name`` (``update_weights``' readers, the checksum), or one
        :class:`~omniloop.weights.WeightUpdateError` naming the package that provides it."""
        mechanism = self.registry.mechanisms.get(name)
        if mechanism is None:
            raise _weights.WeightUpdateError(field, f"needs the {name} mechanism: pip install {MECHANISMS[name]}")
        return mechanism

    def sleep(self, timeout: float = 600.0) -> int:
        """Release the device memory of the weights (moved to host memory) and caches, after the
        requests in flight finish; requests are refused until :meth:`wake`. Returns the bytes moved."""
        result: int = self._when_idle(lambda: self._sleeper.sleep(self.model.components), timeout)
        return result

    def wake(self) -> None:
        """Restore what :meth:`sleep` released (the same values, bit for bit)."""
        with self._runs_lock:
            self._sleeper.wake()

    @property
    def asleep(self) -> bool:
        return self._sleeper.asleep

    def describe(self) -> dict[str, Any]:
        return {
            "family": self.family.name,
            "model": str(self.model_path),
            "device": str(self.device),
            "dtype": self.deploy.dtype,
            "tasks": sorted(t.value for t in self.tasks),
            "plugins": sorted(self.components_enabled),
            "attention_backend": self.attention.name,
            "linear_precision": self.deploy.linear_precision,
            "linear_precision_options": dict(self.deploy.linear_precision_options),
            "scheduler": self.deploy.scheduler,
            "adapters": self.adapters.describe() if self.adapters is not None else [],
            "limits": attrs.asdict(self.deploy.limits),
            "model_limits": self.model_limits.as_dict() if self.model_limits is not None else None,
            "weight_version": self.weight_version,
        }


def structure_node_params(spec: PipelineSpec, req: OmniRequest) -> dict[str, Any]:
    """``req.node_params`` validated against the pipeline's node schemas (defaults for the rest):
    the one place node params are parsed. Raises :class:`RequestError` naming the dotted path."""
    out: dict[str, Any] = {}
    nodes = {n.name: n for n in spec.nodes}
    for name, params in req.node_params.items():
        node = nodes.get(name)
        if node is None:
            raise RequestError(f"node_params.{name}", f"no node named {name!r} in the {req.task.value} pipeline (nodes: {', '.join(nodes)})")
        if node.params_schema is None:
            raise RequestError(f"node_params.{name}", f"node {name!r} takes no parameters")
        out[name] = structure_params(node.params_schema, params, f"node_params.{name}")
    for name, node in nodes.items():
        if name not in out and node.params_schema is not None:
            out[name] = structure_params(node.params_schema, {}, f"node_params.{name}")
    return out


def _refuse_unimplemented(deploy: DeployConfig) -> None:
    """Deploy fields that exist in the schema but have no behaviour yet are refused, never ignored."""
    # transport: checked against the registered transports (omniloop.placement.check_transport)
    if deploy.pipeline is not None or deploy.models:
        raise DeployError(
            f"pipeline: {deploy.pipeline!r} is a composed deploy (pipeline + models by role); load it with "
            "Runtime.from_deploy (omniloop-compose's runtime loader) or check it with omniloop.runtime.check_request"
        )
    if deploy.pipeline_options:  # only a composed deploy has pipeline nodes to give options to
        raise DeployError(
            f"pipeline_options: a single-model deploy has no composed pipeline to give node options to "
            f"(got {', '.join(sorted(map(str, deploy.pipeline_options)))}); pipeline_options go with "
            "pipeline + models (a composed deploy); a node of this model's pipeline is tuned per request "
            "(node_params) and the family through options")


def _non_default_fields(obj: Any) -> list[str]:
    """The attrs fields of ``obj`` that differ from their defaults, in declaration order."""
    default = type(obj)()
    return [f.name for f in attrs.fields(type(obj)) if getattr(obj, f.name) != getattr(default, f.name)]


def _defaults_of(family: Any, model: LoadedModel, task: TaskType) -> dict[str, Any]:
    if task in model.defaults:
        return dict(model.defaults[task])
    return dict(family.task_defaults(model, task)) if capabilities_of(family).task_defaults else {}


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise DeployError(f"device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeployError(f"device: {name!r} requested but CUDA is not available on this machine")
    return dev


def _safe_detect(family: Any, path: Path) -> bool:
    try:
        return bool(family.detect(path))
    except KeyboardInterrupt:
        raise
    except BaseException:  # a family's detect that fails (even with SystemExit) does not detect
        return False


def _tasks_of(family: Any, model: LoadedModel) -> frozenset[TaskType]:
    """What ``model`` (loaded or inspected) can do; see :attr:`Runtime.supported_tasks`."""
    if capabilities_of(family).supported_tasks:
        return frozenset(TaskType(t) for t in family.supported_tasks(model))
    if model.tasks is not None:
        return frozenset(model.tasks)
    declared = model.config.get("tasks")
    if declared:
        try:
            return frozenset(TaskType(t) for t in declared)
        except ValueError:
            pass
    return frozenset(family.tasks)


def _manager_of(manager: PluginManager | str | None) -> PluginManager:
    """The plugin manager ``manager`` names: itself, the installed plugins (None), or what a
    ``"module:function"`` spec returns (the form worker processes re-create a manager from)."""
    if isinstance(manager, str):
        import importlib

        module, _, fn = manager.partition(":")
        made: PluginManager = getattr(importlib.import_module(module), fn)()
        return made
    return manager or default_manager()


def _takes_runtime(factory: Any) -> bool:
    import inspect

    try:
        return len(inspect.signature(factory).parameters) >= 1
    except (TypeError, ValueError):
        return False
