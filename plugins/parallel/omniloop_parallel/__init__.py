"""omniloop-parallel: run a deployment's compute in N worker processes (SPMD).

``ParallelRuntime(deploy)`` validates the deploy (``parallel: {sp, cfg}``) without loading
weights, then starts ``sp * cfg`` workers in one ``torch.distributed`` process group (gloo on CPU,
NCCL on CUDA; :mod:`omniloop_parallel.group`). Every rank loads the model and runs the same request
unit by unit; rank 0 owns scheduling and broadcasts each decision (run, go on, abort, stop)
(:mod:`omniloop_parallel.worker`). See README.md.
"""

from .pool import ParallelRuntime, WorkerDied

__all__ = ["ParallelRuntime", "WorkerDied"]
