"""cache-dit's context manager, subclassed for the two things we need to change.

* ``similarity`` reduces over the pool's sequence-parallel process group (cache-dit's own
  ``parallelized=True`` path all-reduces over the default WORLD group, twice). Every rank of an
  SP group must reach the same cache decision, or the middle blocks' collectives deadlock.
* A lock guards the manager's single "current context" pointer, held only around bookkeeping
  (never around block compute), so two threads stepping different requests on one transformer
  cannot select each other's context.

Nothing is monkeypatched: the subclass is used only by our interceptor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ._cachedit import CachedContextManager


def group_is_active(group: Any) -> bool:
    """True when ``group`` is a process group of more than one rank that we must reduce over."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return False
    return bool(dist.get_world_size(group) > 1)


class OmniloopContextManager(CachedContextManager):  # type: ignore[misc]
    """One per loaded transformer (block list); holds one context per (request, branch)."""

    def __init__(self, name: str, process_group: Any = None) -> None:
        super().__init__(name=name, persistent_context=False)
        self.process_group = process_group
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def selected(self, context_name: str) -> Iterator[None]:
        """Select ``context_name`` as the current context (no auto-refresh), under the lock."""
        with self.lock, self.enter_context(context_name):
            yield

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def similarity(
        self,
        t1: torch.Tensor,
        t2: torch.Tensor,
        *,
        threshold: float,
        parallelized: bool = False,
        prefix: str = "Fn",
    ) -> bool:
        # ``parallelized`` is ignored on purpose: the group to reduce over is ours, not WORLD.
        if not group_is_active(self.process_group):
            return bool(super().similarity(t1, t2, threshold=threshold, parallelized=False, prefix=prefix))
        return self._reduced_similarity(t1, t2, threshold=threshold)

    def _reduced_similarity(self, t1: torch.Tensor, t2: torch.Tensor, *, threshold: float) -> bool:
        # Same special cases as CachedContextManager.similarity (decided identically on every
        # rank from the shared threshold, so no collective is needed for them).
        if threshold <= 0.0:
            self.add_residual_diff(-0.0)
            return False
        if threshold >= 1.0:
            self.add_residual_diff(-1.0)
            return True
        if self.get_important_condition_threshold() > 0.0:
            raise NotImplementedError("important_condition_threshold is not supported under sequence parallelism")
        # One collective: [sum|prev - cur|, sum|prev|, shape mismatch]. Sums, not means, so that
        # uneven shards still give the exact global ratio.
        if t1.shape == t2.shape:
            stats = torch.stack([(t1 - t2).abs().sum(dtype=torch.float32), t1.abs().sum(dtype=torch.float32)])
            stats = torch.cat([stats, stats.new_zeros(1)])
        else:
            stats = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float32, device=t1.device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.process_group)
        host = stats.tolist()  # the one host sync of the decision
        if host[2] > 0:
            self.add_residual_diff(-2.0)
            return False
        diff = host[0] / host[1] if host[1] != 0.0 else float("inf")
        self.add_residual_diff(diff)
        return diff < threshold
