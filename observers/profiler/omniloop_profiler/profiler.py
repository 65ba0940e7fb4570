"""The ``profiler`` observer: wall and device time per node, step and block, peak memory.

Everything is kept per request id (interleaved requests do not mix). Nothing synchronizes the
device unless ``sync`` is set: CUDA events are recorded at each boundary and read once at the
end of the request. Block times come from block taps (the time between consecutive block outputs
of a branch forward; the first block of a forward also carries what ran before it since the
previous tap or step start), so they exist only when ``blocks`` is configured.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import attrs
import torch

from omniloop.hookspecs import hookimpl
from omniloop.observers import BLOCK_TAP

from .config import ProfilerConfig

log = logging.getLogger("omniloop.profiler")



def _rss_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@attrs.define
class _Span:
    key: tuple[Any, ...]
    t0: float
    ev0: Any = None
    t1: float | None = None
    ev1: Any = None
    peak: int | None = None


@attrs.define
class _Req:
    t0: float
    cuda: bool
    nodes: list[_Span] = attrs.Factory(list)
    steps: list[_Span] = attrs.Factory(list)
    blocks: list[_Span] = attrs.Factory(list)
    open_node: _Span | None = None
    open_step: _Span | None = None
    mark: tuple[float, Any] | None = None
    trace: dict[str, Any] | None = None


class Profiler:
    """Observer object created by the ``profiler`` plugin (one per runtime)."""

    needs_eager = False
    _active_trace: Any = None  # torch.profiler is process-global: one window at a time

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        self.config = config or ProfilerConfig()
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._live: dict[str, _Req] = {}
        self._device: torch.device | None = None

    # -- API ------------------------------------------------------------------------------------
    def bind(self, runtime: Any) -> None:
        """Pin the profiler to ``runtime``'s device (otherwise each request's deploy device is used)."""
        self._device = torch.device(runtime.device)

    def get_report(self, request_id: str) -> dict[str, Any] | None:
        """The report of a finished request (the last ``keep`` are kept), or None."""
        return self.reports.get(request_id)

    @property
    def last_report(self) -> dict[str, Any] | None:
        return next(reversed(self.reports.values()), None) if self.reports else None

    # -- helpers --------------------------------------------------------------------------------
    def _is_cuda(self, deploy: Any = None) -> bool:
        if self._device is not None:
            return self._device.type == "cuda"
        device = getattr(deploy, "device", None)
        if device is not None:  # the deployment says where the request runs
            return torch.device(device).type == "cuda"
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _now(self, r: _Req) -> tuple[float, Any]:
        if r.cuda and self.config.sync:
            torch.cuda.synchronize()
        ev = None
        if r.cuda and self.config.device_time:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        return time.perf_counter(), ev

    def _nvtx_push(self, r: _Req, msg: str) -> None:
        if r.cuda and self.config.nvtx:
            torch.cuda.nvtx.range_push(msg)

    def _nvtx_pop(self, r: _Req) -> None:
        if r.cuda and self.config.nvtx:
            torch.cuda.nvtx.range_pop()

    def _peak(self, r: _Req) -> int | None:
        if not self.config.memory:
            return None
        return int(torch.cuda.max_memory_allocated()) if r.cuda else _rss_peak_bytes()

    # -- observer events ----------------------------------------------------------------------------
    @hookimpl
    def omniloop_request_start(self, request: Any, pipeline: Any, deploy: Any) -> None:
        cuda = self._is_cuda(deploy)
        self._live[request.request_id] = _Req(t0=time.perf_counter(), cuda=cuda)
        if cuda and self.config.memory:
            torch.cuda.reset_peak_memory_stats()

    @hookimpl
    def omniloop_node_start(self, request: Any, node: str) -> None:
        r = self._live.get(request.request_id)
        if r is None:
            return
        self._nvtx_push(r, f"omniloop node {node}")
        if r.cuda and self.config.memory:
            torch.cuda.reset_peak_memory_stats()
        t, ev = self._now(r)
        r.open_node = _Span(key=(node,), t0=t, ev0=ev)

    @hookimpl
    def omniloop_node_end(self, request: Any, node: str, seconds: float) -> None:
        r = self._live.get(request.request_id)
        if r is None or r.open_node is None:
            return
        t, ev = self._now(r)
        span = r.open_node
        span.t1, span.ev1, span.peak = t, ev, self._peak(r)
        r.nodes.append(span)
        r.open_node = None
        self._nvtx_pop(r)

    @hookimpl
    def omniloop_step_start(self, request: Any, node: str, step: int, total: int) -> None:
        r = self._live.get(request.request_id)
        if r is None:
            return
        self._maybe_start_trace(request, r, node, step)
        self._nvtx_push(r, f"omniloop {node} step {step}")
        t, ev = self._now(r)
        r.open_step = _Span(key=(node, step), t0=t, ev0=ev)
        r.mark = (t, ev)

    @hookimpl
    def omniloop_step_end(self, request: Any, node: str, step: int, total: int, loop: Any, seconds: float) -> None:
        r = self._live.get(request.request_id)
        if r is None or r.open_step is None:
            return
        t, ev = self._now(r)
        span = r.open_step
        span.t1, span.ev1 = t, ev
        r.steps.append(span)
        r.open_step = None
        r.mark = None
        self._nvtx_pop(r)
        w = self.config.trace_steps
        if r.trace is not None and w is not None and step >= w[1]:
            self._stop_trace(r)

    @hookimpl
    def omniloop_request_end(self, request: Any, output: Any) -> None:
        rid = request.request_id
        r = self._live.pop(rid, None)
        if r is None:
            return
        if r.trace is not None:
            self._stop_trace(r)
        if r.cuda and self.config.nvtx:  # a failed node or step left its range open
            for _ in range(int(r.open_node is not None) + int(r.open_step is not None)):
                torch.cuda.nvtx.range_pop()
        report = self._report(request, output, r)
        self.reports[rid] = report
        while len(self.reports) > self.config.keep:
            self.reports.popitem(last=False)
        if self.config.json:
            try:
                write_json(report, Path(self.config.json.format(request_id=rid)))
            except OSError as exc:  # a report that cannot be written must not fail the request
                log.error("profiler: cannot write %s: %s", self.config.json, exc)

    # -- torch.profiler window ----------------------------------------------------------------------
    def _maybe_start_trace(self, request: Any, r: _Req, node: str, step: int) -> None:
        w = self.config.trace_steps
        if w is None or r.trace is not None or step != w[0]:
            return
        if Profiler._active_trace is not None:
            log.warning(
                "profiler: a torch.profiler window is already open (another request); not tracing %s",
                request.request_id,
            )
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.cuda else [])
        prof = profile(activities=acts, record_shapes=True)
        prof.__enter__()
        Profiler._active_trace = prof
        r.trace = {
            "prof": prof,
            "node": node,
            "steps": list(w),
            "path": self.config.trace_out.format(request_id=request.request_id),
        }

    def _stop_trace(self, r: _Req) -> None:
        assert r.trace is not None
        prof = r.trace.pop("prof", None)
        if prof is None:
            return
        try:
            prof.__exit__(None, None, None)
            path = Path(r.trace["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            log.info("profiler: wrote torch.profiler trace of steps %s to %s", r.trace["steps"], path)
        except Exception as exc:
            log.error("profiler: torch.profiler trace failed: %s: %s", type(exc).__name__, exc)
            r.trace["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            Profiler._active_trace = None

    # -- the report ----------------------------------------------------------------------------------
    def _report(self, request: Any, output: Any, r: _Req) -> dict[str, Any]:
        if r.cuda and self.config.device_time:
            torch.cuda.synchronize()  # the events must have completed before they can be read

        def dev(span: _Span) -> float | None:
            if span.ev0 is None or span.ev1 is None:
                return None
            return round(span.ev0.elapsed_time(span.ev1) / 1000.0, 9)

        def wall(span: _Span) -> float:
            return round((span.t1 or span.t0) - span.t0, 9)

        nodes = [
            {"node": s.key[0], "wall_s": wall(s), "device_s": dev(s), "peak_memory_bytes": s.peak} for s in r.nodes
        ]
        steps = [{"node": s.key[0], "step": s.key[1], "wall_s": wall(s), "device_s": dev(s)} for s in r.steps]
        step_summary: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(s["node"] for s in steps):
            ws = [s["wall_s"] for s in steps if s["node"] == name]
            ds = [s["device_s"] for s in steps if s["node"] == name and s["device_s"] is not None]
            step_summary[name] = {
                "count": len(ws),
                "total_s": round(sum(ws), 9),
                "mean_s": statistics.fmean(ws),
                "median_s": statistics.median(ws),
                "min_s": min(ws),
                "max_s": max(ws),
                "device_mean_s": statistics.fmean(ds) if ds else None,
            }
        blocks: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        for s in r.blocks:
            node, name = s.key[0], s.key[1]
            b = blocks.setdefault(
                (node, name), {"node": node, "name": name, "count": 0, "total_s": 0.0, "device_total_s": None}
            )
            b["count"] += 1
            b["total_s"] += wall(s)
            d = dev(s)
            if d is not None:
                b["device_total_s"] = (b["device_total_s"] or 0.0) + d
        for b in blocks.values():
            b["mean_s"] = b["total_s"] / b["count"]
            b["device_mean_s"] = b["device_total_s"] / b["count"] if b["device_total_s"] is not None else None
        peaks = [n["peak_memory_bytes"] for n in nodes if n["peak_memory_bytes"] is not None]
        memory = None
        if self.config.memory:
            memory = {
                "kind": "cuda_max_allocated" if r.cuda else "process_peak_rss",
                "peak_bytes": max(peaks) if peaks else self._peak(r),
            }
        trace = None
        if r.trace is not None:
            trace = {k: v for k, v in r.trace.items() if k != "prof"}
        status = getattr(output.status, "value", str(output.status))
        return {
            "request_id": request.request_id,
            "status": status,
            "device": "cuda" if r.cuda else "cpu",
            "synchronized": bool(r.cuda and self.config.sync),
            "total_s": round(time.perf_counter() - r.t0, 9),
            "nodes": nodes,
            "steps": steps,
            "step_summary": step_summary,
            "blocks": list(blocks.values()),
            "memory": memory,
            "trace": trace,
        }


class BlockProfiler(Profiler):
    """The profiler with block timing (``blocks`` configured): listens to block taps, needs eager."""

    needs_eager = True

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        super().__init__(config)
        assert self.config.blocks is not None
        self._blocks = re.compile(self.config.blocks)
        log.info(
            "profiler: timing blocks matching %r; blocks run eagerly while the profiler is enabled", self.config.blocks
        )

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return self.config.blocks

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        r = self._live.get(request.request_id)
        if r is None or r.mark is None:
            return
        t, ev = self._now(r)
        if BLOCK_TAP.search(name) and self._blocks.search(name):
            r.blocks.append(_Span(key=(node, name), t0=r.mark[0], ev0=r.mark[1], t1=t, ev1=ev))
            if r.cuda and self.config.nvtx:
                torch.cuda.nvtx.mark(f"omniloop {node} {name}")
        r.mark = (t, ev)


def make_profiler(config: ProfilerConfig | None) -> Profiler:
    config = config or ProfilerConfig()
    return BlockProfiler(config) if config.blocks else Profiler(config)


def write_json(report: dict[str, Any], path: Path) -> Path:
    """Write a report as JSON (atomically: a temporary file moved into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
