"""Rich progress for one execution: a line per node, a bar per loop node (step i of n)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def console(stderr: bool = False) -> Console:
    """A console over the *current* sys.stdout/sys.stderr (click's test runner swaps them)."""
    return Console(stderr=stderr, soft_wrap=True)


class RunProgress:
    """Consumes an execution's events (``progress.update(event)``) and draws per-node progress."""

    def __init__(self, con: Console, execution: Any) -> None:
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=con, transient=False,
        )
        self.nodes = [n.name for n in execution.nodes]
        self.tasks: dict[str, Any] = {}
        self.totals: dict[str, int] = {}
        for node in execution.nodes:
            total = None if getattr(node, "is_loop", False) else 1
            self.tasks[node.name] = self.progress.add_task(node.name, total=total, start=False)
            self.totals[node.name] = total or 1
        self._current = 0

    def __enter__(self) -> RunProgress:
        self.progress.start()
        self._start(0)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def _start(self, index: int) -> None:
        self._current = index
        if index < len(self.nodes):
            self.progress.start_task(self.tasks[self.nodes[index]])

    def update(self, event: Any) -> None:
        kind = getattr(event.kind, "value", event.kind)
        if kind not in ("progress", "node") or event.node not in self.tasks:
            return
        task = self.tasks[event.node]
        if kind == "progress":  # one loop step finished
            self.totals[event.node] = event.total or 1
            self.progress.update(task, total=event.total, completed=event.step)
            return
        # a node finished
        total = self.totals[event.node]
        self.progress.update(task, total=total, completed=total)
        i = self.nodes.index(event.node)
        self._start(i + 1)
