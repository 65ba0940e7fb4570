"""Sessions of Wan's causal rollout: omniloop-kit's :mod:`omniloop_kit.causal` (the names this module had)."""

from omniloop_kit.causal import Cancelled, Session, SessionError, SessionLimit, SessionStore

__all__ = ["Cancelled", "Session", "SessionError", "SessionLimit", "SessionStore"]
