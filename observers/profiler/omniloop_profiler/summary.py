"""A rich rendering of a profiler report (what ``omniloop generate --profile`` prints)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _table(title: str, columns: tuple[str, ...], rows: Iterable[tuple[Any, ...]], *, left: int = 1) -> Table:
    """A table titled ``title`` (left-justified): the first ``left`` columns left-aligned, the
    numbers right-aligned, one row per item of ``rows``."""
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def summary_table(report: dict[str, Any], *, top_blocks: int = 10) -> Group:
    """Tables for nodes, steps (per loop node) and the slowest blocks of one report."""
    dev = report.get("device", "cpu")
    mem = report.get("memory") or {}
    mem_label = "peak MiB (CUDA)" if mem.get("kind") == "cuda_max_allocated" else "peak RSS MiB"
    sync = " (synchronized)" if report.get("synchronized") else ""
    nodes = _table(
        f"profile of {escape(str(report.get('request_id')))} · {report.get('status')} · {dev}{sync}",
        ("node", "wall ms", "device ms", mem_label),
        ((escape(n["node"]), _ms(n["wall_s"]), _ms(n["device_s"]), _mib(n["peak_memory_bytes"]))
         for n in report.get("nodes", [])),
    )
    nodes.add_row(Text("total", style="bold"), _ms(report.get("total_s")), "", _mib(mem.get("peak_bytes")))
    parts: list[Any] = [nodes]
    if report.get("step_summary"):
        parts.append(_table(
            "steps", ("node", "steps", "mean ms", "median ms", "min ms", "max ms", "device mean ms"),
            ((escape(name), str(s["count"]), *(_ms(s[k]) for k in ("mean_s", "median_s", "min_s", "max_s", "device_mean_s")))
             for name, s in report["step_summary"].items()),
        ))
    blocks = sorted(report.get("blocks", []), key=lambda b: -b["total_s"])[:top_blocks]
    if blocks:
        parts.append(_table(
            f"blocks (slowest {len(blocks)} by total wall time)",
            ("node", "block", "calls", "total ms", "mean ms", "device mean ms"),
            ((escape(b["node"]), escape(b["name"]), str(b["count"]), _ms(b["total_s"]), _ms(b["mean_s"]),
              _ms(b["device_mean_s"])) for b in blocks),
            left=2,
        ))
    trace = report.get("trace")
    if trace:
        msg = f"torch.profiler trace of steps {trace.get('steps')}: {trace.get('path')}"
        parts.append(Text(msg + (f" (failed: {trace['error']})" if trace.get("error") else "")))
    return Group(*parts)
