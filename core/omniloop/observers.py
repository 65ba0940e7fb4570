"""The observer bus: read-only events, bound when a pipeline is built.

Each event attribute of :class:`ObserverBus` is either a pluggy hook caller (some enabled
observer implements it) or ``None``. Stages and the execution check ``if bus.step_end is not
None`` — an event nobody implements is never called and costs one attribute read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from .hookspecs import OBSERVER_EVENTS
from .plugins import new_pluggy_manager


class ObserverBus:
    request_start: Any
    request_end: Any
    node_start: Any
    node_end: Any
    loop_init: Any
    loop_finalize: Any
    step_start: Any
    step_end: Any
    tap: Any
    wants_block_taps: Any
    schedule_decision: Any

    def __init__(self, observers: Sequence[tuple[str, Any]] = ()) -> None:
        self.names = tuple(name for name, _ in observers)
        self.observers = tuple(obj for _, obj in observers)
        self.pm = new_pluggy_manager()
        for name, obj in observers:
            self.pm.register(obj, name=name)
        for ev in OBSERVER_EVENTS:
            caller = getattr(self.pm.hook, ev)
            short = ev[len("omniloop_"):]
            setattr(self, short, caller if caller.get_hookimpls() else None)
        self.needs_eager = any(bool(getattr(o, "needs_eager", False)) for o in self.observers)

    @property
    def empty(self) -> bool:
        return not self.observers

    def block_tap_pattern(self, node: str) -> re.Pattern[str] | None:
        """One regex joining every observer's requested block-module pattern for ``node``."""
        if self.wants_block_taps is None:
            return None
        pats = [p for p in self.wants_block_taps(node=node) if p]
        if not pats:
            return None
        return re.compile("|".join(f"(?:{p.pattern if hasattr(p, 'pattern') else p})" for p in pats))


#: a block tap's name ends in its index (``blocks.3``); other taps are named values (``noise_pred``)
BLOCK_TAP = re.compile(r"\.\d+$")


class TapFilter:
    """Which ``omniloop_tap`` values an observer takes: named taps matching ``taps`` and, when
    ``blocks`` is set, block outputs matching ``blocks`` (block taps need eager blocks, so
    :attr:`needs_eager` follows ``blocks``). Block taps another observer asked for are skipped."""

    def __init__(self, taps: str, blocks: str | None, *, observer: str, doing: str) -> None:
        self.taps = re.compile(taps)
        self.blocks = re.compile(blocks) if blocks else None
        self.needs_eager = self.blocks is not None
        if self.needs_eager:
            logging.getLogger(f"omniloop.{observer}").info(
                "%s: %s block outputs matching %r; blocks run eagerly", observer, doing, blocks
            )

    def kind(self, name: str) -> str | None:
        """``"block"``, ``"tap"``, or None when the observer does not take this tap."""
        if BLOCK_TAP.search(name):
            return "block" if self.blocks is not None and self.blocks.search(name) else None
        return "tap" if self.taps.search(name) else None
