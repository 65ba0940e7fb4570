"""Entry point of omniloop-comfyui: adds ``omniloop comfy compile`` and ``omniloop comfy check``."""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import comfy  # click and the compiler import only when the CLI asks

    cli.add_command(comfy)
