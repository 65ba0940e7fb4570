"""Entry point of omniloop-parallel: registers the transports ``inproc``, ``shm``, ``torch.distributed``."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

from .transports import SPECS

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_transports(register: Any) -> None:
    for spec in SPECS:
        register(spec)
