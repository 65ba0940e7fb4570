"""The worker's Prometheus metrics, appended to the Dynamo system server's ``/metrics``.

Dynamo's runtime already exports per-endpoint request counts, in-flight and durations
(``dynamo_component_*``). These add what a diffusion worker knows and Dynamo cannot infer from
tokens: the engine's queue, and the predicted cost (seconds on this worker's device) of the
requests it holds, so that a planner or a custom router can weigh a 30 s 1080p job against a
2 s 480p one (``omniloop_dynamo_outstanding_predicted_seconds`` is the load signal).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

REQUEST_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> str:
    items = {**base, **(extra or {})}
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in items.items()) + "}"


class WorkerMetrics:
    """Counters the handler updates (event-loop thread) and the exposition callback reads."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (kind, outcome) -> count
        self.inflight = 0
        self.outstanding_predicted = 0.0
        self.predicted_sum = 0.0
        self.predicted_count = 0
        self.seconds_sum = 0.0
        self.seconds_count = 0
        self.abs_error_sum = 0.0  # |actual - predicted| over requests with a prediction
        self.seconds_buckets = [0] * (len(REQUEST_BUCKETS) + 1)
        self.draining = False
        self.probes = 0
        self.last_predicted: float | None = None

    def start(self, predicted: float | None) -> None:
        with self.lock:
            self.inflight += 1
            if predicted is not None:
                self.outstanding_predicted += predicted
                self.predicted_sum += predicted
                self.predicted_count += 1
                self.last_predicted = predicted

    def finish(self, kind: str, outcome: str, predicted: float | None, seconds: float | None) -> None:
        with self.lock:
            self.inflight -= 1
            if predicted is not None:
                self.outstanding_predicted = max(0.0, self.outstanding_predicted - predicted)
            self.count(kind, outcome)
            if seconds is not None:
                self.seconds_sum += seconds
                self.seconds_count += 1
                i = next((j for j, b in enumerate(REQUEST_BUCKETS) if seconds <= b), len(REQUEST_BUCKETS))
                self.seconds_buckets[i] += 1
                if predicted is not None and outcome == "completed":
                    self.abs_error_sum += abs(seconds - predicted)

    def count(self, kind: str, outcome: str) -> None:
        key = (kind, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def reject(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.count(kind, outcome)

    def render(self, engine_stats: Mapping[str, Any] | None = None) -> str:
        """Prometheus text exposition (the ``register_prometheus_expfmt_callback`` payload)."""
        base = {"model": self.model}
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, Mapping[str, str] | None, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{_labels(base, labels)} {float(value):.9g}")

        with self.lock:
            metric("omniloop_dynamo_requests_total", "counter", "Requests by kind (video/image) and outcome.",
                   [("", {"kind": k, "outcome": o}, n) for (k, o), n in sorted(self.requests.items())])
            metric("omniloop_dynamo_inflight_requests", "gauge", "Requests this worker holds (queued or running).",
                   [("", None, self.inflight)])
            metric("omniloop_dynamo_outstanding_predicted_seconds", "gauge",
                   "Sum of the predicted seconds of the requests this worker holds (its load in device time).",
                   [("", None, self.outstanding_predicted)])
            metric("omniloop_dynamo_request_predicted_seconds", "summary",
                   "Predicted seconds per request at submit (the per-request cost estimate).",
                   [("_sum", None, self.predicted_sum), ("_count", None, self.predicted_count)])
            metric("omniloop_dynamo_request_prediction_abs_error_seconds", "counter",
                   "Sum of |actual - predicted| seconds over completed requests.", [("", None, self.abs_error_sum)])
            cum, buckets = 0, []
            for b, c in zip((*REQUEST_BUCKETS, float("inf")), self.seconds_buckets, strict=True):
                cum += c
                buckets.append(("_bucket", {"le": "+Inf" if b == float("inf") else repr(b)}, cum))
            metric("omniloop_dynamo_request_seconds", "histogram", "Seconds from submit to response ready.",
                   [*buckets, ("_sum", None, self.seconds_sum), ("_count", None, self.seconds_count)])
            metric("omniloop_dynamo_health_checks_total", "counter", "Health canaries answered.",
                   [("", None, self.probes)])
            metric("omniloop_dynamo_draining", "gauge", "1 while the worker drains after SIGTERM.",
                   [("", None, 1.0 if self.draining else 0.0)])
        if engine_stats:
            s = engine_stats
            gauges = [("waiting", "Requests queued in the engine."), ("running", "Requests admitted (interleaved).")]
            for key, help_ in gauges:
                if isinstance(s.get(key), (int, float)):
                    metric(f"omniloop_engine_{key}_requests", "gauge", help_, [("", None, s[key])])
            for key, help_ in (("step_forwards", "Model forwards run by the step loop."),
                               ("batched_forwards", "Forwards that co-batched several requests."),
                               ("request_steps", "Request steps run (a batched forward counts each member).")):
                if isinstance(s.get(key), (int, float)):
                    metric(f"omniloop_engine_{key}_total", "counter", help_, [("", None, s[key])])
            if isinstance(s.get("finished"), Mapping):
                metric("omniloop_engine_finished_total", "counter", "Engine requests by final status.",
                       [("", {"status": k}, v) for k, v in sorted(s["finished"].items())])
            if isinstance(s.get("rejected"), Mapping):
                metric("omniloop_engine_rejected_total", "counter", "Engine submissions refused, by reason.",
                       [("", {"reason": k}, v) for k, v in sorted(s["rejected"].items())])
        return "\n".join(out) + "\n"


__all__ = ["WorkerMetrics"]
