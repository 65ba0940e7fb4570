"""Errors raised at omniloop's boundaries.

Every boundary (request JSON, deploy file, checkpoint on disk, plugin package) raises one of
these with a message a person can act on; the CLI prints ``str(err)`` as one line, no traceback.
"""

from __future__ import annotations


class OmniloopError(Exception):
    """Base class of every error omniloop raises on purpose."""


class RequestError(OmniloopError):
    """A request is invalid. ``path`` is the dotted field path (``diffusion.steps``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class DeployError(OmniloopError):
    """A deploy config is invalid or names something that cannot be loaded."""


class PluginError(OmniloopError):
    """A plugin failed to load, declared an unsupported hook-API range, or clashed with another."""


class CheckpointError(OmniloopError):
    """A checkpoint on disk is missing, partial or malformed. The message names the file."""


class GraphError(OmniloopError):
    """A PipelineSpec failed validation (missing producer, type mismatch, cycle, duplicate)."""


class CancelledError(OmniloopError):
    """Raised inside a request's execution when it was cancelled between steps."""
