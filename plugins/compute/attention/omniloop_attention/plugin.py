"""Entry point of omniloop-attention."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_attention_backends(register: Any) -> None:
    from .backends import BACKENDS  # on registration: loading this plugin imports no torch (issue 42)

    for spec in BACKENDS:
        register(spec)
