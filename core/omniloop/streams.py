"""Draining a synchronous event stream: :func:`final_output`. The per-request event streams of
asynchronous front ends (``EventStream``) are omniloop-scheduler's ``omniloop_scheduler.streams``
since omniloop 0.2 (issue 34)."""

from __future__ import annotations

from collections.abc import Iterable

from .lazy import moved
from .request import OmniEvent, OmniOutput


def final_output(events: Iterable[OmniEvent]) -> OmniOutput:
    """Drain a synchronous event stream (``Runtime.stream`` and the runtimes built like it) and
    return its final output — what every ``generate(request)`` is."""
    out: OmniOutput | None = None
    for ev in events:
        if ev.output is not None:
            out = ev.output
    if out is None:
        raise RuntimeError("the event stream ended without a final output")
    return out


__getattr__ = moved(__name__, {"EventStream": "omniloop_scheduler.streams"})

__all__ = ["final_output"]
