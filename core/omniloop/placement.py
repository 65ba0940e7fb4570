"""Deploy checks of mechanisms the single-process runtime runs itself, before any weight loads:
:func:`check_transport` (the deploy's ``transport`` is registered and fits it) and
:func:`check_attention_grid` (a backend that needs the self-attention token grid, e.g. ``sparse-tile``).

The checks of ``parallel: {sp, cfg}`` and ``placement`` (role pools) moved with the loader that runs
those deploys to omniloop-parallel (``omniloop_parallel.checks``), ``check_offload`` with the
offloader to omniloop-offload (``omniloop_offload.check_offload``): the core imports no plugin.
"""

from __future__ import annotations

from typing import Any

from .capabilities import AXES as AXES  # re-exported (its old home)
from .capabilities import capabilities_of
from .deploy import DeployConfig
from .errors import DeployError
from .lazy import moved

#: names that moved to omniloop-parallel and omniloop-offload (issue 34: the core imports no plugin)
_moved = moved(__name__, {"check_offload": "omniloop_offload", **dict.fromkeys(
    ("check_parallel", "check_in_pool", "check_roles", "role_device", "check_roles_in_pool"), "omniloop_parallel.checks")})


def __getattr__(name: str) -> Any:
    if name == "pool_factory":
        raise ImportError("omniloop.placement.pool_factory is gone (omniloop 0.2, issue 34): Runtime.from_deploy runs "
                          "parallel and placement deploys through the runtime loaders plugins register")
    return _moved(name)


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
