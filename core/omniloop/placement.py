"""Placement checks: the deploy's ``parallel: {sp, cfg}`` validated before any weight loads.

:func:`check_parallel` runs in :class:`~omniloop.runtime.Deployment` (so ``Deployment.check`` and
every front end refuse a bad layout at once): the world size is the product of the axes, every
axis above 1 must be declared by the family (``capabilities.parallel.axes``) and stay within its
``capabilities.parallel.limits`` (Wan: ``cfg`` at most 2, one rank per guidance branch), ``sp`` must divide the
transformer's attention heads (``capabilities.parallel.attention_heads(path)``), and the machine must have a
device (CUDA) or a core (CPU) per rank; block interceptors (cache-dit, fbcache) run under
parallelism only with a family that binds them to its sequence-parallel group
(``capabilities.parallel.block_interceptors``; Wan does), so every rank takes the same skip decision. Each failure is one line naming ``parallel.<axis>``.

:func:`check_in_pool` runs in :class:`~omniloop.runtime.Runtime`: a deploy with a world size
above 1 only loads inside a process group of that size (omniloop-parallel's worker pool), never
silently on one process.

Role pools (``placement: {vae: {devices: [cpu]}}``): :func:`check_roles` (in ``Deployment``),
:func:`check_roles_in_pool` (a plain ``Runtime`` refuses them) and :func:`pool_factory` (the loader
``Runtime.from_deploy`` hands a multi-process deploy to: omniloop-parallel).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .capabilities import AXES as AXES  # re-exported (its old home)
from .capabilities import capabilities_of
from .deploy import DeployConfig
from .errors import DeployError


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


def check_transport(deploy: DeployConfig, registry: Any) -> None:
    """``deploy.transport`` names a registered transport (``inproc`` always exists) that fits the
    deploy: any other than ``inproc`` carries artifacts between worker processes, so it needs a
    world above 1 or role workers (``placement``). One :class:`DeployError` line otherwise, at load."""
    name = deploy.transport
    if name == "inproc":
        return
    known = sorted({"inproc", *getattr(registry, "transports", {})})
    if name not in known:
        raise DeployError(
            f"transport: {name!r} is not implemented yet: no installed transport has that name "
            f"(available: {', '.join(known)}; omniloop-parallel adds shm and torch.distributed)"
        )
    if deploy.parallel.world_size == 1 and not deploy.placement:
        raise DeployError(
            f"transport: {name!r} carries artifacts between worker processes; this deploy runs in one process "
            "(set parallel: {sp, cfg} or placement, or use 'inproc')"
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


def check_offload(deploy: DeployConfig, family: Any, device: torch.device,
                  options: dict[str, Any] | None = None) -> None:
    """``deploy.offload`` (``model`` / ``sequential``, :mod:`omniloop.offload`) can run: the family
    declares what moves (``capabilities.offload``), the device is ``cuda`` (or ``cpu``, where
    storage and device are the same and only the machinery runs), and nothing the offloader cannot
    follow is enabled — LoRA adapters (their weights sit on the load device), ``compile`` (the
    compiled blocks would see weights change device), a parallel world above 1, role pools
    (``placement``) — and the family's
    own ``capabilities.offload.refusal(mode, options)`` (a reason string or None; Wan: a causal rollout calls
    its blocks functionally, so it cannot stream them) has no objection to the family ``options``.
    One :class:`DeployError` line, before any weight loads."""
    mode = deploy.offload
    if mode == "none":
        return
    decl = capabilities_of(family).offload
    if decl is None:
        raise DeployError(
            f"offload: family {family.name!r} does not support offload (it declares no capabilities.offload); "
            "remove the field or set it to 'none'"
        )
    if device.type not in ("cuda", "cpu"):
        raise DeployError(f"offload: {mode!r} moves weights between host memory and a CUDA device, not {device.type!r}")
    if deploy.parallel.world_size > 1:
        raise DeployError(f"offload: {mode!r} runs in one process; it does not combine with parallel: {_axes(deploy)} yet")
    if deploy.adapters:
        raise DeployError(f"offload: {mode!r} does not combine with LoRA adapters yet (adapters: {', '.join(sorted(deploy.adapters))})")
    if getattr(deploy, "placement", None):
        raise DeployError(f"offload: {mode!r} does not combine with placement (role pools) yet")
    if deploy.compile:
        raise DeployError(f"offload: {mode!r} does not combine with compile: true yet (compiled blocks would see their weights move)")
    refusal = decl.refusal
    why = refusal(mode, dict(options if options is not None else deploy.options)) if refusal is not None else None
    if why:
        raise DeployError(f"offload: {mode!r} {why}")


# -- role pools (``placement``: components whose stages run in worker processes) -------------------


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


def pool_factory(deploy: DeployConfig) -> Any:
    """The loader of a deploy that needs worker processes (``parallel`` world above 1, or
    ``placement``): omniloop-parallel's ``runtime_for(deploy, manager=...)``; None for a one-process
    deploy. :meth:`omniloop.runtime.Runtime.from_deploy` calls it (and so every front end that loads
    through it)."""
    if deploy.parallel.world_size == 1 and not deploy.placement:
        return None
    try:
        from omniloop_parallel import runtime_for
    except ImportError:
        what = "placement" if deploy.placement else f"parallel: {_axes(deploy)}"
        raise DeployError(f"{what}: needs worker processes: pip install omniloop-parallel (plugins/parallel)") from None
    return runtime_for


# -- attention backends that need the token grid (``accepts_grid``, e.g. sparse-tile) -------------


def check_attention_grid(deploy: DeployConfig, family: Any, attention: Any, options: dict[str, Any]) -> None:
    """A backend whose callable declares ``accepts_grid`` (``sparse-tile``) computes its pattern only
    on calls where the family passes the self-attention token grid; anywhere else it computes dense
    attention. Such a deploy loads only when the family declares ``capabilities.attention_grid(deploy,
    options)`` (a reason string or None) and it has no objection (Wan objects to ``parallel.sp > 1``
    and the causal rollout) — never a silent dense fallback under a sparse name. One
    :class:`DeployError` line, before any weight loads."""
    if attention is None or not getattr(attention.fn, "accepts_grid", False):
        return
    name = getattr(attention, "name", "?")
    refusal = capabilities_of(family).attention_grid
    if refusal is None:
        raise DeployError(
            f"attention_backend: {name!r} needs each self-attention call's token grid, and family "
            f"{family.name!r} passes none: it would compute dense attention; use another backend"
        )
    why = refusal(deploy, options)
    if why:
        raise DeployError(f"attention_backend: {name!r} needs each self-attention call's token grid, and {why}")
