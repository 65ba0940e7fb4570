"""omniloop schedulers: ``serial`` (request at a time) and ``step`` (interleaved, batched)."""

from .serial import SerialScheduler

__all__ = ["SerialScheduler"]
