"""A rich rendering of a profiler report (what ``omniloop generate --profile`` prints)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def summary_table(report: dict[str, Any], *, top_blocks: int = 10) -> Group:
    """Tables for nodes, steps (per loop node) and the slowest blocks of one report."""
    dev = report.get("device", "cpu")
    mem = report.get("memory") or {}
    mem_label = "peak MiB (CUDA)" if mem.get("kind") == "cuda_max_allocated" else "peak RSS MiB"
    sync = " (synchronized)" if report.get("synchronized") else ""
    nodes = Table(
        title=f"profile of {escape(str(report.get('request_id')))} · {report.get('status')} · {dev}{sync}",
        title_justify="left",
    )
    nodes.add_column("node")
    nodes.add_column("wall ms", justify="right")
    nodes.add_column("device ms", justify="right")
    nodes.add_column(mem_label, justify="right")
    for n in report.get("nodes", []):
        nodes.add_row(escape(n["node"]), _ms(n["wall_s"]), _ms(n["device_s"]), _mib(n["peak_memory_bytes"]))
    nodes.add_row(Text("total", style="bold"), _ms(report.get("total_s")), "", _mib(mem.get("peak_bytes")))
    parts: list[Any] = [nodes]
    if report.get("step_summary"):
        steps = Table(title="steps", title_justify="left")
        for col in ("node", "steps", "mean ms", "median ms", "min ms", "max ms", "device mean ms"):
            steps.add_column(col, justify="left" if col == "node" else "right")
        for name, s in report["step_summary"].items():
            steps.add_row(
                escape(name),
                str(s["count"]),
                _ms(s["mean_s"]),
                _ms(s["median_s"]),
                _ms(s["min_s"]),
                _ms(s["max_s"]),
                _ms(s["device_mean_s"]),
            )
        parts.append(steps)
    blocks = sorted(report.get("blocks", []), key=lambda b: -b["total_s"])[:top_blocks]
    if blocks:
        bt = Table(title=f"blocks (slowest {len(blocks)} by total wall time)", title_justify="left")
        for col in ("node", "block", "calls", "total ms", "mean ms", "device mean ms"):
            bt.add_column(col, justify="left" if col in ("node", "block") else "right")
        for b in blocks:
            bt.add_row(
                escape(b["node"]),
                escape(b["name"]),
                str(b["count"]),
                _ms(b["total_s"]),
                _ms(b["mean_s"]),
                _ms(b["device_mean_s"]),
            )
        parts.append(bt)
    trace = report.get("trace")
    if trace:
        msg = f"torch.profiler trace of steps {trace.get('steps')}: {trace.get('path')}"
        parts.append(Text(msg + (f" (failed: {trace['error']})" if trace.get("error") else "")))
    return Group(*parts)
