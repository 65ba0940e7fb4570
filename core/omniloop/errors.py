"""Errors raised at omniloop's boundaries.

Every boundary (request JSON, deploy file, checkpoint on disk, plugin package) raises one of
these with a message a person can act on; the CLI prints ``str(err)`` as one line, no traceback.
"""

from __future__ import annotations


class OmniloopError(Exception):
    """Base class of every error omniloop raises on purpose."""


#: the longest path and message a RequestError keeps (echoing a 1 MB bad value helps nobody)
MAX_PATH_CHARS, MAX_MESSAGE_CHARS = 200, 1000


def cap_text(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters (with ``...``) and with invalid Unicode escaped: safe to
    print, log or put in a JSON error reply whatever a client sent."""
    return _cap(text, n)


def _cap(text: str, n: int) -> str:
    text = text if len(text) <= n else text[: n - 3] + "..."
    # a client's lone surrogate must not make the error itself unprintable (or un-JSON-able)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(OmniloopError):
    """A request is invalid. ``path`` is the dotted field path (``diffusion.steps``).

    Both are capped (:data:`MAX_PATH_CHARS`, :data:`MAX_MESSAGE_CHARS`), so an error built from a
    huge client value (a 1 MB dict key) stays short, and invalid Unicode in them is escaped."""

    def __init__(self, path: str, message: str) -> None:
        self.path = _cap(str(path), MAX_PATH_CHARS)
        self.message = _cap(str(message), MAX_MESSAGE_CHARS)
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


class DeployError(OmniloopError):
    """A deploy config is invalid or names something that cannot be loaded.

    The message is capped (2,000 characters, invalid Unicode escaped) like :class:`RequestError`'s."""

    def __init__(self, message: str = "") -> None:
        super().__init__(_cap(str(message), 2 * MAX_MESSAGE_CHARS))


class PluginError(OmniloopError):
    """A plugin failed to load, declared an unsupported hook-API range, or clashed with another."""


class CheckpointError(OmniloopError):
    """A checkpoint on disk is missing, partial or malformed. The message names the file."""


class GraphError(OmniloopError):
    """A PipelineSpec failed validation (missing producer, type mismatch, cycle, duplicate)."""


class CancelledError(OmniloopError):
    """Raised inside a request's execution when it was cancelled between steps."""


class HookDeprecationWarning(DeprecationWarning):
    """A plugin uses a hook, hook argument or plugin method signature scheduled for removal.

    Warned for one minor version after the rename; the old form keeps working meanwhile."""
