"""Entry point of omniloop-server: adds ``omniloop serve`` to the CLI."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import make_serve_command  # click and the server import only when the CLI asks

    cli.add_command(make_serve_command())
