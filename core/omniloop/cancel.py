"""Cancellation inside a step: a running unit checks its request's cancel flag between blocks.

A denoising step of a large model runs dozens of transformer blocks and can take many seconds;
a cancel that waited for the step boundary would wait that long. :class:`~omniloop.execution.Execution`
runs every unit (a stage's ``forward``, a loop's ``init``/``step``, a batched step) inside
:func:`watching`, which makes its cancel flag visible to :func:`check_cancelled`.
:func:`omniloop.interceptors.run_blocks` calls :func:`check_cancelled` before each block, so every
family that runs its blocks through ``run_blocks`` stops within one block of a cancel (Ctrl-C in
the caller's thread raises ``KeyboardInterrupt`` at the next Python instruction, which is no later
than the next block either; the execution then closes the request as ``cancelled`` and re-raises
it). A family with other long Python loops
(a tiled VAE decode, a token loop) may call :func:`check_cancelled` in them too. The check raises
:class:`~omniloop.errors.CancelledError`; the execution ends the request with status
``cancelled`` (interceptors closed, observers told, the complete artifacts kept) and the runtime
stays usable.

The flag is per thread (a :mod:`contextvars` variable): the engine's worker thread and a caller's
thread each see only the unit they run. A check outside any unit does nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import CancelledError

_CURRENT: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("omniloop_cancel", default=None)


@contextmanager
def watching(cancelled: Callable[[], bool]) -> Iterator[None]:
    """Run the enclosed unit with ``cancelled()`` as the flag :func:`check_cancelled` reads."""
    token = _CURRENT.set(cancelled)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def check_cancelled() -> None:
    """Raise :class:`CancelledError` when the unit running in this thread was cancelled."""
    fn = _CURRENT.get()
    if fn is not None and fn():
        raise CancelledError("cancelled while a step was running")


__all__ = ["check_cancelled", "watching"]
