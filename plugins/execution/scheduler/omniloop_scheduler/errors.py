"""Errors raised by the engine at submit time (before any compute)."""

from __future__ import annotations

from omniloop.errors import OmniloopError, RequestError


class QueueFull(OmniloopError):
    """The engine's wait queue holds ``deploy.limits.max_queue`` requests already (HTTP 429)."""

    def __init__(self, depth: int, limit: int) -> None:
        self.depth = depth
        self.limit = limit
        super().__init__(f"the queue is full ({depth} waiting, limit {limit}); retry later")


class AdmissionRefused(RequestError):
    """The request could never fit the scheduler's memory budget, even running alone."""


class EngineClosed(OmniloopError):
    """The engine is shutting down or was not started; it takes no new requests."""
