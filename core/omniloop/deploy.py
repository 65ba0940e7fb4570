"""Deploy config: what a deployment loads and allows. Plugins are enabled here and only here.

Loaded from YAML, TOML or JSON through the same strict converter as requests; errors name the
file and the dotted field path. Example (YAML)::

    model: {family: wan, path: /models/Wan2.1-T2V-1.3B-Diffusers}
    device: cuda
    dtype: bfloat16
    scheduler: step
    attention_backend: sdpa-cudnn
    plugins:
      cache-dit: {Fn: 8, residual_diff_threshold: 0.08}
      profiler: {}
    limits: {max_steps: 100, max_frames: 121, max_height: 1280, max_width: 1280, max_queue: 32}
    adapters: {anime: /loras/anime.safetensors, detail: /loras/detail}   # LoRA, named by requests
    parallel: {sp: 2, cfg: 2}   # 4 worker processes (omniloop-parallel), checked before weights load

A composed deployment names a registered pipeline and one model per role instead of ``model``
(omniloop-compose: :mod:`omniloop_compose`)::

    pipeline: prompt-upsample
    models: {upsampler: {path: /models/Qwen2.5-0.5B-Instruct, options: {kv_cache_tokens: 8192}},
             video: {preset: wan-demo}}
    pipeline_options: {upsample: {max_tokens: 120}}
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
from attrs import define, field

from .errors import DeployError, RequestError
from .schema import structure


@define(frozen=True)
class ModelConfig:
    """Which model: a ``preset`` name (``wan-demo``) or a ``path``; ``family`` when detection is ambiguous."""

    preset: str | None = None
    path: str | None = None
    family: str | None = None


@define(frozen=True)
class RoleModelConfig(ModelConfig):
    """A composed deploy's model for one role (``models.<role>``): a model plus the family options
    of that role only (over the deploy's shared ``options``)."""

    options: dict[str, Any] = attrs.Factory(dict)


@define(frozen=True)
class Limits:
    """Limits enforced on every request before any compute."""

    max_steps: int = field(default=200, metadata={"ge": 1})
    max_frames: int = field(default=257, metadata={"ge": 1})
    max_height: int = field(default=2048, metadata={"ge": 1})
    max_width: int = field(default=2048, metadata={"ge": 1})
    max_queue: int = field(default=64, metadata={"ge": 1})
    #: LoRA adapters kept in memory at once (least recently used out; read again on next use)
    max_adapters: int = field(default=16, metadata={"ge": 1})


@define(frozen=True)
class ParallelConfig:
    """How many processes run one request's compute (omniloop-parallel's worker pool, SPMD).

    ``sp``: Ulysses sequence parallel over attention heads; ``cfg``: the cond and uncond branches
    on different ranks. World size = ``sp * cfg``; checked before any weight loads
    (``omniloop_parallel.checks.check_parallel``, through its runtime loader)."""

    sp: int = field(default=1, metadata={"ge": 1})
    cfg: int = field(default=1, metadata={"ge": 1})

    @property
    def world_size(self) -> int:
        return self.sp * self.cfg


@define(frozen=True)
class RolePlacement:
    """Where one component's stages run (``placement.<component>``): ``devices`` names the worker
    processes, one per device (``cpu``, ``cuda:1``); components placed on the same device share that
    worker. omniloop-parallel's role pools run them; checked before any weight loads
    (``omniloop_parallel.checks.check_roles``, through its runtime loader)."""

    devices: list[str] = attrs.Factory(list)


@define(frozen=True)
class AdminConfig:
    """The server's admin routes (post-training: rollouts, weight updates, sleep/wake), off unless
    the deploy sets ``admin``. ``token_env``: the environment variable holding the bearer token
    every admin route requires; ``weights_dir``: a folder whose ``.safetensors`` files an update
    may name (by file name only); without it updates carry their tensors in the body."""

    token_env: str = field(metadata={"pattern": r"[A-Za-z_][A-Za-z0-9_]{0,127}",
                                     "pattern_hint": "must be an environment variable name"})
    weights_dir: str | None = None


@define(frozen=True)
class DeployConfig:
    model: ModelConfig = attrs.Factory(ModelConfig)
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    scheduler: str = "serial"
    #: how artifacts cross processes: ``inproc`` (default); a registered transport (omniloop-parallel:
    #: ``shm``, ``torch.distributed``) with parallel world > 1; unknown names refused at load
    transport: str = "inproc"
    #: a registered attention backend's name, or ``auto`` (the default): the fastest exact-class
    #: backend that declares itself for this machine and deploy (``AttentionBackendSpec.auto_rank``;
    #: omniloop-attention's ``flash-attn-4`` for Wan on Hopper in bf16/fp16 when installed), else ``sdpa``.
    #: The chosen name is in ``Runtime.describe()["attention_backend"]``
    attention_backend: str = "auto"
    #: the attention backend's options, e.g. {density: 0.3} for ``sparse-tile`` (checked against the
    #: backend's ``options_schema`` at load; a backend without one takes none)
    attention_options: dict[str, Any] = attrs.Factory(dict)
    compile: bool = False
    #: precision of the linears in the denoiser's transformer blocks: ``dtype`` (the deploy's dtype) or
    #: a name a plugin registered (``omniloop_register_linear_precisions``; e.g. omniloop-quant's
    #: ``fp8``: e4m3 GEMMs, distribution-altering) — checked at load by omniloop.linears
    linear_precision: str = "dtype"
    #: the linear precision's options, e.g. {keep: ["*.to_v", "*.add_v_proj"]} for omniloop-quant's
    #: ``fp8`` (checked against the precision's ``options_schema`` at load; ``dtype`` and a precision
    #: without one take none)
    linear_precision_options: dict[str, Any] = attrs.Factory(dict)
    #: component offload for a GPU smaller than the model (omniloop-offload): ``model`` moves each node's
    #: components to the device as it runs, ``sequential`` also streams their blocks one by one; the
    #: family must declare ``capabilities.offload`` (checked at load: omniloop_offload.check_offload)
    offload: Literal["none", "model", "sequential"] = "none"
    #: enabled plugins (interceptors, observers) by name, with their deploy-level config
    plugins: dict[str, dict[str, Any]] = attrs.Factory(dict)
    #: policy choices and defaults for the family (e.g. {"sampler": "unipc"})
    policies: dict[str, Any] = attrs.Factory(dict)
    #: family-specific options passed through to the family (e.g. {"text_cache": True})
    options: dict[str, Any] = attrs.Factory(dict)
    limits: Limits = attrs.Factory(Limits)
    #: scheduler options (e.g. {"max_batch": 8, "memory_budget_gib": 60})
    scheduler_options: dict[str, Any] = attrs.Factory(dict)
    #: options of ``omniloop serve`` (request-size limits, sessions, connections), validated by
    #: omniloop-server's ``ServerOptions`` when the deployment is served
    server: dict[str, Any] = attrs.Factory(dict)
    #: LoRA adapters requests may name: {NAME: PATH} (a .safetensors file or a folder), read at load
    #: (omniloop-adapters); requests refer to them by NAME only
    adapters: dict[str, str] = attrs.Factory(dict)
    #: fuse one declared adapter into the weights at load: {NAME: SCALE} (single-adapter deployments)
    adapter_fuse: dict[str, float] = attrs.Factory(dict)
    #: multi-process parallelism of one request's compute, e.g. {sp: 2, cfg: 2} (omniloop-parallel)
    parallel: ParallelConfig = attrs.Factory(ParallelConfig)
    #: role pools: components whose stages run in worker processes, e.g. {vae: {devices: [cpu]}} (VAE
    #: decode of one request overlaps another's denoise; omniloop-parallel; omniloop_parallel.checks.check_roles)
    placement: dict[str, RolePlacement] = attrs.Factory(dict)
    #: a composed pipeline by its registered name (``prompt-upsample``); with ``models`` instead of
    #: ``model``: one model per role (omniloop-compose; ``Runtime.from_deploy`` hands it to its runtime loader)
    pipeline: str | None = None
    #: the composed pipeline's models by role, e.g. {upsampler: {path: ...}, video: {preset: wan-demo}}
    models: dict[str, RoleModelConfig] = attrs.Factory(dict)
    #: the composed pipeline's node options by node, e.g. {upsample: {instruction: ..., max_tokens: 120}}
    pipeline_options: dict[str, Any] = attrs.Factory(dict)
    #: front-end aliases for ComfyUI workflows (omniloop-comfyui checks them):
    #: ``{models: {FILE_NAME: MODEL_NAME}, loras: {FILE_NAME: ADAPTER_NAME}}``
    comfyui: dict[str, Any] = attrs.Factory(dict)
    #: the server's admin routes (``/v1/rollout/generate``, ``/v1/weights/*``, ``/v1/sleep``,
    #: ``/v1/wake``): off unless set; every call needs the bearer token from ``token_env``
    admin: AdminConfig | None = None

    def with_model(self, **changes: Any) -> DeployConfig:
        return attrs.evolve(self, model=attrs.evolve(self.model, **changes))


def deploy_from_dict(data: Mapping[str, Any], source: str = "deploy config") -> DeployConfig:
    if not isinstance(data, Mapping):
        raise DeployError(f"{source}: expected a mapping at the top level")
    try:
        cfg = structure(dict(data), DeployConfig)
    except RequestError as exc:
        raise DeployError(f"{source}: {exc}") from None
    for name, conf in cfg.plugins.items():
        if not isinstance(conf, Mapping):
            raise DeployError(f"{source}: plugins.{name}: expected a mapping of options (use {{}} for defaults)")
    return cfg


def check_in_process(deploy: DeployConfig, front_end: str) -> None:
    """Refuse, with one :class:`DeployError`, a deploy that an in-process engine cannot drive.

    Front ends built on an async engine that steps one :class:`~omniloop.runtime.Runtime`'s
    executions in their own process (``omniloop serve``, the Dynamo worker) call this on the deploy
    before any weights load. Refused: a composed deploy (``pipeline`` / ``models``: one runtime per
    role) and ``parallel`` above one process (omniloop-parallel's SPMD pool runs each request in its
    workers, one at a time). A ``placement`` deploy (role pools) is fine: its runtime is a Runtime.
    """
    if deploy.pipeline is not None or deploy.models:
        raise DeployError(
            f"pipeline: {front_end} cannot serve a composed deploy (pipeline {deploy.pipeline!r}) yet: its "
            "step/serial engine drives one model's execution, a composed deploy runs one runtime per role; "
            "use `omniloop generate --deploy` or Runtime.from_deploy(...) in Python")
    if deploy.parallel.world_size > 1:
        p = deploy.parallel
        raise DeployError(
            f"parallel: {front_end} cannot serve a parallel deploy (sp {p.sp}, cfg {p.cfg}) yet: its engine steps "
            "requests in this process, the worker pool runs them in its workers; use `omniloop generate --deploy` "
            "or omniloop_parallel.ParallelRuntime in Python")


#: the most values a deploy file may hold once its YAML aliases are expanded (a real one holds
#: hundreds; nine nested levels of ten aliases would be a billion, and minutes of CPU to read)
MAX_DEPLOY_NODES = 100_000


def expanded_size(data: Any, limit: int, source: str) -> int:
    """How many values ``data`` holds with shared (aliased) parts counted every time they are
    reached — what reading it costs; a :class:`DeployError` past ``limit``. Computed once per
    distinct object, so the count itself is cheap."""
    memo: dict[int, int] = {}

    def size(obj: Any, depth: int) -> int:
        if not isinstance(obj, (dict, list)):
            return 1
        key = id(obj)
        if key in memo:
            return memo[key]
        if depth > 64:
            raise DeployError(f"{source}: nested deeper than 64 levels")
        memo[key] = limit + 1  # a cycle (a YAML alias inside itself) counts as too large
        items = list(obj.keys()) + list(obj.values()) if isinstance(obj, dict) else obj
        n = 1
        for item in items:
            n += size(item, depth + 1)
            if n > limit:
                break
        memo[key] = n
        return n

    n = size(data, 0)
    if n > limit:
        raise DeployError(f"{source}: more than {limit} values once its YAML aliases are expanded (alias bomb?)")
    return n


def load_deploy(source: str | os.PathLike[str] | Mapping[str, Any] | DeployConfig) -> DeployConfig:
    """Load a deploy config from a file (``.yaml``/``.yml``/``.toml``/``.json``), a dict, or pass one through."""
    if isinstance(source, DeployConfig):
        return source
    if isinstance(source, Mapping):
        return deploy_from_dict(source)
    path = Path(source)
    if not path.is_file():
        raise DeployError(f"{path}: deploy file not found")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise DeployError(f"{path}: YAML deploy files need PyYAML (pip install 'omniloop[yaml]')") from None
            data = yaml.safe_load(text)
            expanded_size(data, MAX_DEPLOY_NODES, str(path))  # YAML aliases: bounded expansion
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise DeployError(f"{path}: unknown deploy file type {suffix!r} (use .yaml, .toml or .json)")
    except DeployError:
        raise
    except Exception as exc:  # parse errors of three libraries
        raise DeployError(f"{path}: cannot parse: {exc}") from None
    return deploy_from_dict(data if data is not None else {}, source=str(path))
