"""Engine counters and histograms, updated atomically so they always add up:

``submitted == waiting + running + sum(finished.values())`` at every snapshot.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics). Not locked: the owner locks."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cum, out = 0, []
        for b, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cum += c
            out.append((b, cum))
        return {"buckets": out, "sum": self.sum, "count": self.count}


class EngineMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submitted = 0
        self.waiting = 0
        self.running = 0
        self.finished = {"completed": 0, "failed": 0, "cancelled": 0}
        self.rejected = {"invalid": 0, "queue_full": 0, "refused": 0, "closed": 0}
        self.step_forwards = 0
        self.batched_forwards = 0
        self.request_steps = 0
        self.stage_units = 0
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.stage_seconds = Histogram(STEP_BUCKETS)
        self.request_seconds = Histogram(REQUEST_BUCKETS)
        self.queue_seconds = Histogram(REQUEST_BUCKETS)

    # all mutators are called with the lock *not* held
    def try_submit(self, max_waiting: int) -> int | None:
        """Count a submission unless ``max_waiting`` wait already; returns the depth when refused."""
        with self.lock:
            if self.waiting >= max_waiting:
                return self.waiting
            self.submitted += 1
            self.waiting += 1
            return None

    def on_reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def on_admit(self, queued_seconds: float) -> None:
        with self.lock:
            self.waiting -= 1
            self.running += 1
            self.queue_seconds.observe(queued_seconds)

    def on_finish(self, status: str, admitted: bool, seconds: float) -> None:
        with self.lock:
            if admitted:
                self.running -= 1
            else:
                self.waiting -= 1
            self.finished[status] = self.finished.get(status, 0) + 1
            self.request_seconds.observe(seconds)

    def on_unit(self, action: str, members: int, seconds: float) -> None:
        with self.lock:
            if action in ("step", "batched_step"):
                self.step_forwards += 1
                self.request_steps += members
                if members > 1:
                    self.batched_forwards += 1
                self.step_seconds.observe(seconds)
            elif action == "stage":
                self.stage_units += 1
                self.stage_seconds.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "submitted": self.submitted,
                "waiting": self.waiting,
                "running": self.running,
                "finished": dict(self.finished),
                "rejected": dict(self.rejected),
                "step_forwards": self.step_forwards,
                "batched_forwards": self.batched_forwards,
                "request_steps": self.request_steps,
                "stage_units": self.stage_units,
                "step_seconds": self.step_seconds.snapshot(),
                "stage_seconds": self.stage_seconds.snapshot(),
                "request_seconds": self.request_seconds.snapshot(),
                "queue_seconds": self.queue_seconds.snapshot(),
            }
