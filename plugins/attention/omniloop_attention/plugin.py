"""Entry point of omniloop-attention."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

from .backends import BACKENDS

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_attention_backends(register: Any) -> None:
    for spec in BACKENDS:
        register(spec)
