"""A progress bar over generated clips, on stderr (stdout keeps a command's tables): what the demo
families' ``eval`` commands show while a sweep runs (the first numbers come after minutes
otherwise). Needs ``rich`` (a dependency of the families that use it), imported on use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def clip_progress(n_steps: int, total: int) -> Iterator[Callable[[int], None]]:
    """A transient bar labelled ``"<n_steps> steps"`` over ``total`` clips; yields ``advance(k)``."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn(f"{n_steps} steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("clips", total=total)
        yield lambda k: bar.advance(task, k)


__all__ = ["clip_progress"]
