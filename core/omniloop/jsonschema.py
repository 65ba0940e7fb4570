"""Moved: the request's JSON Schema is omniloop-io's ``omniloop_io.jsonschema`` since omniloop 0.2 (issue 34)."""

from .lazy import moved

__getattr__ = moved(__name__, "omniloop_io.jsonschema")
