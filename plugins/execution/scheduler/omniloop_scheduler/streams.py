"""Per-request event streams for asynchronous front ends (engines, servers, workers); the core's
``omniloop.streams`` until omniloop 0.2 (issue 34: only asynchronous front ends use it).

:class:`EventStream` keeps one request's events for replay and its final output; engines append
events from their compute thread (through ``loop.call_soon_threadsafe``) and call ``_notify``;
any number of :meth:`EventStream.events` iterators (late ones replay from the start) and
:meth:`EventStream.result` waiters follow in the event loop. Used by :class:`~omniloop_scheduler.
RequestHandle` and omniloop-dynamo's fallback engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from omniloop.request import EventKind, OmniEvent, OmniOutput


class EventStream:
    """One request's events kept for replay and its final output, awaited in the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.output: OmniOutput | None = None
        self._loop = loop
        self._events: list[OmniEvent] = []
        self._changed = asyncio.Event()
        self._result: asyncio.Future[OmniOutput] = loop.create_future()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _finish(self, output: OmniOutput) -> None:
        self.output = output
        if not self._result.done():
            self._result.set_result(output)

    def done(self) -> bool:
        return self.output is not None

    async def result(self, timeout: float | None = None) -> OmniOutput:
        return await asyncio.wait_for(asyncio.shield(self._result), timeout)

    async def events(self) -> AsyncIterator[OmniEvent]:
        """Every event of this request from the start (late subscribers replay), until final."""
        i = 0
        while True:
            changed = self._changed
            while i < len(self._events):
                ev = self._events[i]
                i += 1
                yield ev
                if ev.kind is EventKind.FINAL:
                    return
            if self.output is not None:
                return
            await changed.wait()


__all__ = ["EventStream"]
