"""The checks of a deploy's ``parallel: {sp, cfg}`` and ``placement`` (role pools), before any
weight loads, and the runtime loader that ``Runtime.from_deploy`` hands such deploys to (moved here
from ``omniloop.placement``, so the core imports no plugin: issue 34).

:func:`check_parallel` runs in :class:`~omniloop.runtime.Deployment` through this package's
:data:`LOADER` (so ``Deployment.check`` and every front end refuse a bad layout at once): the world
size is the product of the axes, every axis above 1 must be declared by the family
(``capabilities.parallel.axes``) and stay within its ``capabilities.parallel.limits`` (Wan: ``cfg``
at most 2, one rank per guidance branch), ``sp`` must divide the transformer's attention heads
(``capabilities.parallel.attention_heads(path)``), and the machine must have a device (CUDA) or a
core (CPU) per rank; block interceptors (cache-dit, fbcache) run under parallelism only with a
family that binds them to its sequence-parallel group (``capabilities.parallel.block_interceptors``;
Wan does), so every rank takes the same skip decision. Each failure is one line naming
``parallel.<axis>``.

:func:`check_in_pool` runs when a plain :class:`~omniloop.runtime.Runtime` is built for such a
deploy (``RuntimeLoaderSpec.check_direct``): a world size above 1 only loads inside a process group
of that size (this package's worker pool), never silently on one process; :func:`check_roles_in_pool`
refuses ``placement`` there (only :class:`~omniloop_parallel.RolePoolRuntime` runs it).

Role pools (``placement: {vae: {devices: [cpu]}}``): :func:`check_roles` (in ``Deployment``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from omniloop.capabilities import AXES, capabilities_of
from omniloop.deploy import DeployConfig
from omniloop.errors import DeployError
from omniloop.family import RuntimeLoaderSpec


def check_parallel(deploy: DeployConfig, family: Any, model_path: Path, device: torch.device,
                   block_interceptors: tuple[str, ...] = ()) -> None:
    """Raise :class:`DeployError` (one line) when ``deploy.parallel`` cannot run; nothing is loaded."""
    par = deploy.parallel
    world = par.world_size
    if world == 1:
        return
    decl = capabilities_of(family).parallel
    supported = decl.axes if decl is not None else frozenset()
    for axis in AXES:
        n = getattr(par, axis)
        if n > 1 and axis not in supported:
            axes = ", ".join(sorted(supported)) or "none"
            raise DeployError(
                f"parallel.{axis}: family {family.name!r} does not support {axis!r} parallelism (it supports: {axes})"
            )
    limits = dict(decl.limits) if decl is not None else {}
    for axis, most in limits.items():
        n = getattr(par, axis, 1)
        if n > most:
            raise DeployError(f"parallel.{axis}: {n} is more than family {family.name!r} can use (at most {most})")
    if par.sp > 1:
        fn = decl.attention_heads if decl is not None else None
        heads = fn(model_path) if fn is not None else None
        if not isinstance(heads, int) or heads < 1:
            raise DeployError(f"parallel.sp: family {family.name!r} cannot tell the attention heads of {model_path}")
        if heads % par.sp:
            raise DeployError(
                f"parallel.sp: {par.sp} does not divide the transformer's {heads} attention heads "
                f"(Ulysses splits the heads across ranks)"
            )
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if world > gpus:
            raise DeployError(f"parallel: {_axes(deploy)} needs {world} GPUs, this machine has {gpus}")
    elif device.type == "cpu":
        cores = os.cpu_count() or 1
        if world > cores:
            raise DeployError(f"parallel: {_axes(deploy)} needs {world} processes, this machine has {cores} CPU cores")
    else:
        raise DeployError(f"parallel: device {device.type!r} has no multi-process support (use cuda or cpu)")
    if block_interceptors and not (decl is not None and decl.block_interceptors):
        raise DeployError(
            f"plugins.{block_interceptors[0]}: block interceptors do not run under parallel: {_axes(deploy)} yet "
            f"with family {family.name!r} (it does not synchronise their skip decisions across ranks)"
        )


def check_in_pool(deploy: DeployConfig) -> None:
    """A world above 1 loads only inside a ``torch.distributed`` group of that size."""
    world = deploy.parallel.world_size
    if world == 1:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world):
        raise DeployError(
            f"parallel: {_axes(deploy)} runs in {world} processes: load it through omniloop-parallel's worker "
            "pool (omniloop_parallel.ParallelRuntime), not a single-process Runtime"
        )


def _axes(deploy: DeployConfig) -> str:
    p = deploy.parallel
    return "{" + f"sp: {p.sp}, cfg: {p.cfg}" + "}"


def check_roles(deploy: DeployConfig, family: Any, model_path: Path, device: torch.device) -> None:
    """``deploy.placement`` (role pools, omniloop-parallel) can run, before any weight loads.

    Each key names a component the family lets run outside the scheduler's process
    (``capabilities.role_components``; Wan: ``text_encoder``, ``image_encoder``, ``vae`` — the denoise loop's
    transformer stays where the scheduler steps it) that the checkpoint has (``model_index.json``
    when there is one); ``devices`` lists at least one device, each once, each one this machine has
    (``cpu`` or an existing ``cuda:N``); one worker process per distinct device, and on a CPU
    deploy one core per process (the scheduler's plus the workers). Role pools do not combine with
    ``parallel`` yet. One :class:`DeployError` line naming ``placement.<component>`` otherwise."""
    roles = deploy.placement
    if not roles:
        return
    if deploy.parallel.world_size > 1:
        raise DeployError(f"placement: role workers do not combine with parallel: {_axes(deploy)} yet (use one or the other)")
    placeable = capabilities_of(family).role_components
    if not placeable:
        raise DeployError(f"placement: family {family.name!r} declares no components that can run in role workers")
    index = _model_index_components(model_path)
    workers: set[str] = set()
    for comp, role in roles.items():
        if comp not in placeable:
            raise DeployError(
                f"placement.{comp}: family {family.name!r} cannot run {comp!r} in a role worker "
                f"(placeable: {', '.join(sorted(placeable))})"
            )
        if index is not None and comp not in index:
            raise DeployError(f"placement.{comp}: the checkpoint at {model_path} has no {comp!r} component")
        if not role.devices:
            raise DeployError(f"placement.{comp}.devices: give at least one device (e.g. [cpu] or [cuda:1])")
        seen: set[str] = set()
        for i, name in enumerate(role.devices):
            dev = role_device(name, f"placement.{comp}.devices[{i}]")
            if str(dev) in seen:
                raise DeployError(f"placement.{comp}.devices[{i}]: {str(dev)!r} is listed twice (one worker per device)")
            seen.add(str(dev))
        workers |= seen
    if device.type == "cpu" and all(w == "cpu" for w in workers):
        cores = os.cpu_count() or 1
        if 1 + len(workers) > cores:
            raise DeployError(f"placement: {len(workers)} role worker(s) plus the scheduler's process need "
                              f"{1 + len(workers)} CPU cores, this machine has {cores}")


def role_device(name: str, where: str) -> torch.device:
    """The device a role worker runs on (``cpu``, ``cuda``, ``cuda:N``; ``cuda`` means ``cuda:0``)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeployError(f"{where}: {name!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeployError(f"{where}: role workers run on cpu or cuda devices, not {dev.type!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if index >= gpus:
        raise DeployError(f"{where}: {name!r} requested but this machine has {gpus} CUDA device(s)")
    return torch.device("cuda", index)


def _model_index_components(model_path: Path) -> frozenset[str] | None:
    """The components a diffusers-format checkpoint lists (``model_index.json``), or None."""
    import json

    try:
        data = json.loads((Path(model_path) / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return frozenset(k for k in data if not k.startswith("_")) if isinstance(data, dict) else None


def check_roles_in_pool(deploy: DeployConfig) -> None:
    """A deploy with ``placement`` loads only through omniloop-parallel's role pools, never silently
    in one process (which would ignore the placement)."""
    if deploy.placement:
        raise DeployError(
            f"placement: {', '.join(sorted(deploy.placement))} run in role worker processes: load the deploy with "
            "Runtime.from_deploy (omniloop-parallel's RolePoolRuntime), not a plain Runtime"
        )


def _claims(deploy: DeployConfig) -> bool:
    return deploy.parallel.world_size > 1 or bool(deploy.placement)


def _check(deployment: Any, block_interceptors: tuple[str, ...]) -> None:
    d = deployment
    check_parallel(d.deploy, d.family, d.model_path, d.device, block_interceptors)  # parallel: {sp, cfg}
    check_roles(d.deploy, d.family, d.model_path, d.device)  # placement: role workers


def _check_direct(deploy: DeployConfig) -> None:
    check_in_pool(deploy)  # a world above 1 loads only inside this package's pool
    check_roles_in_pool(deploy)  # placement: only through RolePoolRuntime


def _load(deploy: DeployConfig, *, manager: Any = None) -> Any:
    from .roles import runtime_for

    return runtime_for(deploy, manager=manager)


#: what ``Runtime.from_deploy`` hands a ``parallel`` (world above 1) or ``placement`` deploy to
LOADER = RuntimeLoaderSpec(
    name="parallel", fields=("parallel", "placement"), claims=_claims, load=_load, check=_check,
    check_direct=_check_direct,
    description="worker processes: an SPMD pool for parallel: {sp, cfg}, role pools for placement",
)
