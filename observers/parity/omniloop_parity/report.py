"""Rich renderings of recordings and comparison results (used by the CLI)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .compare import ParityResult, TapComparison
from .recording import Recording


def _err(c: TapComparison | None) -> Text:
    if c is None:
        return Text("-", style="dim")
    if c.reason in ("missing in B", "shape"):
        return Text(c.reason, style="bold red")
    if c.reason == "only in B":
        return Text("only B", style="dim")
    s = "0" if c.max_abs == 0 else f"{c.max_abs:.2e}"
    if c.entry.kind == "block" and c.max_abs > 0:
        s += f" ({c.entry.name})"
    return Text(s, style="green" if c.passed else "bold red")


def result_table(result: ParityResult) -> Table:
    """Per step, the largest absolute error of each tap (red where beyond tolerance)."""
    columns, rows = result.table()
    t = Table(title="largest abs error per step and tap", title_justify="left")
    t.add_column("step", justify="right")
    for col in columns:
        t.add_column(escape(col), justify="right")
    for label, cells in rows:
        t.add_row(escape(label), *[_err(cells.get(col)) for col in columns])
    return t


def result_renderable(result: ParityResult) -> Group:
    parts: list[Any] = [result_table(result)]
    for n in result.notes:
        parts.append(Text(f"note: {n}", style="yellow"))
    if result.passed:
        parts.append(Text(result.summary(), style="bold green"))
    else:
        parts.append(Text(result.summary(), style="bold red"))
    return Group(*parts)


def recording_renderable(rec: Recording, *, all_taps: bool = False) -> Group:
    m = rec.manifest
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    req = m.get("request") or {}
    prompt = " | ".join(p.get("text", "") for p in req.get("inputs", []) if p.get("type") == "text")
    deploy = m.get("deploy") or {}
    model = deploy.get("model") or {}
    rows = [
        ("file", str(rec.path) if rec.path else "(in memory)"),
        ("request", f"{m.get('request_id')} · task {m.get('task')} · seed {m.get('seed')}"),
        ("prompt", prompt or "-"),
        ("family", f"{m.get('family')} · model {model.get('preset') or model.get('path') or '?'}"),
        ("device", f"{m.get('device')} · {m.get('dtype')} · torch {m.get('torch')}"),
        (
            "recorded",
            f"{m.get('created')} · taps {m.get('config', {}).get('taps')!r} · blocks "
            f"{m.get('config', {}).get('blocks')!r}",
        ),
        ("versions", ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items())),
        ("tensors", f"{len(rec)} taps, {sum(t.numel() * t.element_size() for t in rec.tensors.values()) / 1e6:.2f} MB"),
    ]
    for k, v in rows:
        head.add_row(k, escape(v))
    parts: list[Any] = [head]
    if all_taps:
        t = Table(title="taps", title_justify="left")
        for col in ("key", "shape", "dtype", "mean", "std", "absmax"):
            t.add_column(col, justify="right" if col in ("mean", "std", "absmax") else "left")
        for e in rec.entries:
            x = rec[e.key].double()
            mean = f"{float(x.mean()):.4g}" if x.numel() else "-"
            std = f"{float(x.std()):.4g}" if x.numel() > 1 else "-"
            amax = f"{float(x.abs().max()):.4g}" if x.numel() else "-"
            t.add_row(escape(e.key), "x".join(map(str, e.shape)), e.dtype, mean, std, amax)
        parts.append(t)
    else:
        steps: OrderedDict[str, OrderedDict[str, int]] = OrderedDict()
        shapes: OrderedDict[str, str] = OrderedDict()
        for e in rec.entries:
            row = "final" if e.kind == "final" else (str(e.step) if e.step is not None else e.node)
            base = "blocks" if e.kind == "block" else e.name
            label = f"{base}[{e.branch}]" if e.branch else base
            counts = steps.setdefault(row, OrderedDict())
            counts[label] = counts.get(label, 0) + 1
            shape_key = "blocks.*" if e.kind == "block" else (e.key if e.kind == "final" else e.name)
            shapes.setdefault(shape_key, f"{'x'.join(map(str, e.shape))} {e.dtype}")
        t = Table(title="taps per step", title_justify="left")
        t.add_column("step", justify="right")
        t.add_column("taps")
        for row, counts in steps.items():
            t.add_row(escape(row), escape(", ".join(n if c == 1 else f"{n} x{c}" for n, c in counts.items())))
        parts.append(t)
        s = Table(title="shapes", title_justify="left")
        s.add_column("tap")
        s.add_column("shape / dtype")
        for name, shape in shapes.items():
            s.add_row(name, shape)
        parts.append(s)
    return Group(*parts)
