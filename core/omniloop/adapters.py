"""Moved: LoRA adapters are the omniloop-adapters package since omniloop 0.2 (issue 34); a family's
declaration (``AdapterSupport``) is ``omniloop.capabilities``'."""

from .capabilities import AdapterFormatError, AdapterSupport, unknown_keys_error  # noqa: F401  (their old home)
from .lazy import moved

__getattr__ = moved(__name__, "omniloop_adapters")
