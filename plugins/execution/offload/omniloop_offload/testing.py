"""Offload tests for a family (deploy ``offload: model | sequential``, :mod:`omniloop_offload.offload`;
``omniloop.testing.offload`` until omniloop 0.2).

On a CPU the storage and the execution device are both ``cpu``. :func:`strict_offload` swaps a
runtime's offloader for one with :class:`omniloop_offload.PoisonMover` (an evicted weight is NaN)
that records every load, run and prefetch, so an output ``torch.equal`` to the unoffloaded
runtime's means every weight was loaded when it computed; :func:`offload_run` runs one request
both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omniloop.request import OmniOutput
from omniloop.runtime import Runtime

from .offload import PoisonMover, install

#: ``(event, unit name, units resident)`` per offload event (see :func:`omniloop_offload.install`)
Trace = list[tuple[str, str, tuple[str, ...]]]

__all__ = ["Trace", "offload_run", "strict_offload"]


def strict_offload(rt: Runtime, mode: str) -> Trace:
    """Replace ``rt``'s offloader by a strict, tracing one of ``mode``; returns the trace (filled
    as the runtime runs). Pipelines built before are dropped, so the next request wraps anew."""
    trace: Trace = []
    if rt.offload is not None:
        rt.offload.remove()
    rt.offload = install(rt.model, rt.family, mode, rt.device, mover=PoisonMover(rt.device), trace=trace)
    rt._pipelines.clear()
    return trace


def offload_run(make: Callable[..., Runtime], request: Callable[[], dict[str, Any]], mode: str
                ) -> tuple[Runtime, OmniOutput, OmniOutput, Trace]:
    """``(rt, out, ref, trace)``: ``ref`` is ``request()`` run by ``make()``; ``out`` the same request
    run by ``rt = make(offload=mode)`` under :func:`strict_offload` (asserted completed)."""
    ref = make().generate(request())
    rt = make(offload=mode)
    trace = strict_offload(rt, mode)
    out = rt.generate(request())
    assert out.status.value == "completed", out.error
    return rt, out, ref, trace
