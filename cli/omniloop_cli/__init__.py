"""The ``omniloop`` command line (click + rich).

``omniloop plugins``, ``omniloop hooks``, ``omniloop generate``; plugins add subcommands through
the ``omniloop_register_commands`` hook. ``main(args, obj=plugin_manager)`` runs the CLI over a
given :class:`omniloop.plugins.PluginManager` (tests use an isolated one with the toy family).
"""

from __future__ import annotations

from . import commands as _commands  # noqa: F401  (attaches the built-in commands to ``cli``)
from .app import CliError, cli, get_manager, main

__all__ = ["CliError", "cli", "get_manager", "main"]
__version__ = "0.1.0"
