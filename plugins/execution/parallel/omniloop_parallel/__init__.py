"""omniloop-parallel: run a deployment's compute in N worker processes (SPMD).

``ParallelRuntime(deploy)`` validates the deploy (``parallel: {sp, cfg}``) without loading
weights, then starts ``sp * cfg`` workers in one ``torch.distributed`` process group (gloo on CPU,
NCCL on CUDA; :mod:`omniloop_parallel.group`). Every rank loads the model and runs the same request
unit by unit; rank 0 owns scheduling and broadcasts each decision (run, go on, abort, stop)
(:mod:`omniloop_parallel.worker`). ``RolePoolRuntime(deploy)`` runs a deploy's ``placement`` (role
pools: e.g. the VAE decode in its own worker, overlapping other requests' denoise;
:mod:`omniloop_parallel.roles`). See README.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "pool": ("ParallelRuntime", "WorkerDied"),
    "roles": ("RemoteStage", "RoleError", "RolePoolRuntime", "RoleWorker", "runtime_for"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .pool import ParallelRuntime, WorkerDied
    from .roles import RemoteStage, RoleError, RolePoolRuntime, RoleWorker, runtime_for


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}" if module else __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

__all__ = ["ParallelRuntime", "RemoteStage", "RoleError", "RolePoolRuntime", "RoleWorker", "WorkerDied", "runtime_for"]
