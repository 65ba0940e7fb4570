"""Placement checks: the deploy's ``parallel: {sp, cfg}`` validated before any weight loads.

:func:`check_parallel` runs in :class:`~omniloop.runtime.Deployment` (so ``Deployment.check`` and
every front end refuse a bad layout at once): the world size is the product of the axes, every
axis above 1 must be declared by the family (``family.parallel_axes``) and stay within its
``family.parallel_limits`` (Wan: ``cfg`` at most 2, one rank per guidance branch), ``sp`` must divide the
transformer's attention heads (``family.attention_heads(path)``), and the machine must have a
device (CUDA) or a core (CPU) per rank; block interceptors (cache-dit, fbcache) run under
parallelism only with a family that binds them to its sequence-parallel group
(``family.parallel_block_interceptors``; Wan does), so every rank takes the same skip decision. Each failure is one line naming ``parallel.<axis>``.

:func:`check_in_pool` runs in :class:`~omniloop.runtime.Runtime`: a deploy with a world size
above 1 only loads inside a process group of that size (omniloop-parallel's worker pool), never
silently on one process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .deploy import DeployConfig
from .errors import DeployError

#: the axes the core knows; a family declares the subset it implements
AXES = ("sp", "cfg")


def check_parallel(deploy: DeployConfig, family: Any, model_path: Path, device: torch.device,
                   block_interceptors: tuple[str, ...] = ()) -> None:
    """Raise :class:`DeployError` (one line) when ``deploy.parallel`` cannot run; nothing is loaded."""
    par = deploy.parallel
    world = par.world_size
    if world == 1:
        return
    supported = frozenset(getattr(family, "parallel_axes", ()) or ())
    for axis in AXES:
        n = getattr(par, axis)
        if n > 1 and axis not in supported:
            axes = ", ".join(sorted(supported)) or "none"
            raise DeployError(
                f"parallel.{axis}: family {family.name!r} does not support {axis!r} parallelism (it supports: {axes})"
            )
    limits = dict(getattr(family, "parallel_limits", {}) or {})
    for axis, most in limits.items():
        n = getattr(par, axis, 1)
        if n > most:
            raise DeployError(f"parallel.{axis}: {n} is more than family {family.name!r} can use (at most {most})")
    if par.sp > 1:
        fn = getattr(family, "attention_heads", None)
        heads = fn(model_path) if callable(fn) else None
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
    if block_interceptors and not getattr(family, "parallel_block_interceptors", False):
        raise DeployError(
            f"plugins.{block_interceptors[0]}: block interceptors do not run under parallel: {_axes(deploy)} yet "
            f"with family {family.name!r} (it does not synchronise their skip decisions across ranks)"
        )


def check_transport(deploy: DeployConfig, registry: Any) -> None:
    """``deploy.transport`` names a registered transport (``inproc`` always exists) that fits the
    deploy: any other than ``inproc`` carries artifacts between worker processes, so it needs a
    world above 1. One :class:`DeployError` line otherwise, at load."""
    name = deploy.transport
    if name == "inproc":
        return
    known = sorted({"inproc", *getattr(registry, "transports", {})})
    if name not in known:
        raise DeployError(
            f"transport: {name!r} is not implemented yet: no installed transport has that name "
            f"(available: {', '.join(known)}; omniloop-parallel adds shm and torch.distributed)"
        )
    if deploy.parallel.world_size == 1:
        raise DeployError(
            f"transport: {name!r} carries artifacts between worker processes; this deploy runs in one process "
            "(set parallel: {sp, cfg} or use 'inproc')"
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


def check_offload(deploy: DeployConfig, family: Any, device: torch.device) -> None:
    """``deploy.offload`` (``model`` / ``sequential``, :mod:`omniloop.offload`) can run: the family
    declares what moves (``family.offload_components``), the device is ``cuda`` (or ``cpu``, where
    storage and device are the same and only the machinery runs), and nothing the offloader cannot
    follow is enabled — LoRA adapters (their weights sit on the load device), ``compile`` (the
    compiled blocks would see weights change device), a parallel world above 1. One
    :class:`DeployError` line, before any weight loads."""
    mode = deploy.offload
    if mode == "none":
        return
    decl = getattr(family, "offload_components", None)
    if not decl:
        raise DeployError(
            f"offload: family {family.name!r} does not support offload (it declares no offload_components); "
            "remove the field or set it to 'none'"
        )
    if device.type not in ("cuda", "cpu"):
        raise DeployError(f"offload: {mode!r} moves weights between host memory and a CUDA device, not {device.type!r}")
    if deploy.parallel.world_size > 1:
        raise DeployError(f"offload: {mode!r} runs in one process; it does not combine with parallel: {_axes(deploy)} yet")
    if deploy.adapters:
        raise DeployError(f"offload: {mode!r} does not combine with LoRA adapters yet (adapters: {', '.join(sorted(deploy.adapters))})")
    if deploy.compile:
        raise DeployError(f"offload: {mode!r} does not combine with compile: true yet (compiled blocks would see their weights move)")
