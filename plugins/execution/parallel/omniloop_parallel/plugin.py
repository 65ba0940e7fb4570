"""Entry point of omniloop-parallel: registers the transports ``inproc``, ``shm``, ``torch.distributed``
and the runtime loader of ``parallel`` and ``placement`` deploys (``omniloop_parallel.checks.LOADER``).

Imports nothing heavy: the loader imports the worker pool only when a deploy needs it."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.3,<2"  # omniloop_register_runtime_loaders


@hookimpl
def omniloop_register_transports(register: Any) -> None:
    from .transports import SPECS  # on registration: loading this plugin imports no torch (issue 42)

    for spec in SPECS:
        register(spec)


@hookimpl
def omniloop_register_runtime_loaders(register: Any) -> None:
    from .checks import LOADER

    register(LOADER)
