"""Entry point of omniloop-dynamo: adds the ``omniloop dynamo-worker`` command.

Importing this module does not import ai-dynamo: the command loads it when it runs and says how
to install it when it is missing.
"""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .worker import dynamo_worker_command

    cli.add_command(dynamo_worker_command)
