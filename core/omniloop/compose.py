"""Moved: composed deployments are the omniloop-compose package since omniloop 0.2 (issue 34: the
core imports no plugin). ``Runtime.from_deploy`` still loads a ``pipeline:`` deploy, through the
runtime loader omniloop-compose registers."""

from .lazy import moved

__getattr__ = moved(__name__, "omniloop_compose")
