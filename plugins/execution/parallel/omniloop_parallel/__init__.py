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

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "pool": ("ParallelRuntime", "WorkerDied"),
    "roles": ("RemoteStage", "RoleError", "RolePoolRuntime", "RoleWorker", "runtime_for"),
}

if TYPE_CHECKING:
    from .pool import ParallelRuntime, WorkerDied
    from .roles import RemoteStage, RoleError, RolePoolRuntime, RoleWorker, runtime_for


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["ParallelRuntime", "RemoteStage", "RoleError", "RolePoolRuntime", "RoleWorker", "WorkerDied", "runtime_for"]
