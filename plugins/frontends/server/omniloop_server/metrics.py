"""Prometheus text exposition of the engine's and the server's counters (no client library).

The engine updates its counters atomically, so in every scrape
``omniloop_requests_submitted_total == omniloop_queue_depth + omniloop_running +
sum(omniloop_requests_finished_total)``.
"""

from __future__ import annotations

from typing import Any


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}")

    def histogram(self, name: str, help_: str, snap: dict[str, Any]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} histogram")
        for le, count in snap["buckets"]:
            self.lines.append(f'{name}_bucket{{le="{_fmt(le)}"}} {count}')
        self.lines.append(f"{name}_sum {snap['sum']!r}")
        self.lines.append(f"{name}_count {snap['count']}")


def render_metrics(s: dict[str, Any], state: Any) -> str:
    o = _Out()
    o.metric("omniloop_queue_depth", "gauge", "Requests waiting for admission.", [({}, s["waiting"])])
    o.metric("omniloop_running", "gauge", "Requests admitted and running (interleaved).", [({}, s["running"])])
    o.metric("omniloop_requests_submitted_total", "counter", "Requests accepted by the engine.", [({}, s["submitted"])])
    o.metric("omniloop_requests_finished_total", "counter", "Requests that reached a terminal status.",
             [({"status": k}, v) for k, v in sorted(s["finished"].items())])
    o.metric("omniloop_request_failures_total", "counter", "Requests that failed (exception or NaN in a step).",
             [({}, s["finished"].get("failed", 0))])
    rejected = dict(s["rejected"])
    if getattr(state, "invalid_bodies", 0):  # refused by the body schema, before the engine saw them
        rejected["invalid"] = rejected.get("invalid", 0) + state.invalid_bodies
    o.metric("omniloop_requests_rejected_total", "counter",
             "Requests refused: invalid (by the body's schema or at submit), or over the limits.",
             [({"reason": k}, v) for k, v in sorted(rejected.items())])
    o.metric("omniloop_step_forwards_total", "counter", "Loop-step forwards run (a batched forward counts once).",
             [({}, s["step_forwards"])])
    o.metric("omniloop_batched_forwards_total", "counter", "Forwards that ran several requests' steps as one batch.",
             [({}, s["batched_forwards"])])
    o.metric("omniloop_request_steps_total", "counter", "Request loop steps completed.", [({}, s["request_steps"])])
    o.histogram("omniloop_step_seconds", "Wall seconds of one loop-step forward (batched or not).", s["step_seconds"])
    o.histogram("omniloop_stage_seconds", "Wall seconds of one stage (encoder, decoder).", s["stage_seconds"])
    o.histogram("omniloop_request_seconds", "Seconds from submit to a terminal status.", s["request_seconds"])
    o.histogram("omniloop_queue_seconds", "Seconds from submit to admission.", s["queue_seconds"])
    jobs = state.jobs
    o.metric("omniloop_jobs", "gauge", "Video jobs held by the server, by status.",
             [({"status": k}, v) for k, v in sorted(jobs.counts().items())])
    o.metric("omniloop_outputs_written_total", "counter", "Video files written.", [({}, jobs.written)])
    o.metric("omniloop_output_write_failures_total", "counter", "Video files that failed to write.",
             [({}, jobs.write_failures)])
    o.metric("omniloop_http_errors_total", "counter", "HTTP error responses by status code.",
             [({"code": str(k)}, v) for k, v in sorted(state.http_errors.items())])
    o.metric("omniloop_http_unhandled_exceptions_total", "counter",
             "Exceptions no handler expected (each answered with a 500 or a closed connection).",
             [({}, state.unhandled_errors)])
    o.metric("omniloop_job_record_failures_total", "counter", "Final job states that could not be appended to jobs.jsonl.",
             [({}, jobs.record_failures)])
    pressure = state.pressure() if callable(getattr(state, "pressure", None)) else {}
    if "sessions" in pressure:
        o.metric("omniloop_stream_sessions", "gauge", "Causal sessions held by WebSockets (and their cap).",
                 [({"kind": "open"}, pressure["sessions"]["open"]), ({"kind": "max"}, pressure["sessions"]["max"])])
    if "kv" in pressure:
        o.metric("omniloop_causal_kv_blocks", "gauge", "Causal KV pool blocks, free and in total.",
                 [({"kind": "free"}, pressure["kv"]["free_blocks"]), ({"kind": "total"}, pressure["kv"]["num_blocks"])])
    budget = s.get("memory_budget_bytes")
    if budget is not None:
        o.metric("omniloop_memory_budget_bytes", "gauge", "Scheduler memory budget for requests.", [({}, budget)])
    return "\n".join(o.lines) + "\n"
