"""The ``omniloop`` click group: error policy, the plugin manager, and plugin subcommands.

* Errors: every :class:`omniloop.errors.OmniloopError` (bad request, deploy, plugin, checkpoint)
  becomes one red line on stderr and exit code 2; anything unexpected becomes one line and exit
  code 1 (the traceback with ``--debug`` or ``OMNILOOP_DEBUG=1``); Ctrl-C prints ``interrupted``
  and exits 130 (128 + SIGINT, as shells do).
* The plugin manager is the click context object: ``cli.main(obj=manager)`` (or
  ``CliRunner().invoke(cli, args, obj=manager)``) runs the CLI over an isolated manager, which is
  how tests use the toy family; by default it is :func:`omniloop.plugins.default_manager`.
* Plugins add subcommands through ``omniloop_register_commands(cli)``. They are collected lazily,
  the first time a command name is looked up that is not built in (or the command list is shown),
  so ``omniloop generate`` does not pay for it twice. A plugin whose hook fails is marked failed
  in ``omniloop plugins`` and never breaks the CLI.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from omniloop.plugins import PluginManager

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130


class CliError(click.ClickException):
    """One readable line on stderr, no traceback. ``exit_code`` 2 for user errors."""

    def __init__(self, message: str, exit_code: int = EXIT_USER_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        # one line, even if the message carries newlines (e.g. nested errors)
        line = " ".join(self.format_message().split())
        click.secho(f"error: {line}", fg="red", err=True)


def debug_enabled(ctx: click.Context | None = None) -> bool:
    if os.environ.get("OMNILOOP_DEBUG", "") not in ("", "0", "false", "no"):
        return True
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.params.get("debug"))


def get_manager(ctx: click.Context | None = None) -> PluginManager:
    """The plugin manager this CLI run uses: the context object if it is one, else the default."""
    from omniloop.plugins import PluginManager, default_manager

    ctx = ctx or click.get_current_context()
    obj = ctx.find_root().obj
    if isinstance(obj, PluginManager):
        return obj
    return default_manager()


def fail(message: str, exit_code: int = EXIT_USER_ERROR) -> NoReturn:
    raise CliError(message, exit_code)


class OmniloopGroup(click.Group):
    """A click group whose errors follow omniloop's policy and that plugins can extend."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # plugin commands per plugin manager (tests run several managers in one process)
        self._plugin_commands: weakref.WeakKeyDictionary[Any, dict[str, click.Command]] = (
            weakref.WeakKeyDictionary()
        )
        self._shadowed: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()

    # -- plugin subcommands ----------------------------------------------------------------
    def plugin_commands(self, ctx: click.Context) -> dict[str, click.Command]:
        """Commands that installed plugins add (collected once per plugin manager)."""
        manager = get_manager(ctx)
        found = self._plugin_commands.get(manager)
        if found is None:
            collector = click.Group(name=self.name)
            try:
                manager.register_commands(collector)
            except Exception as exc:  # discovery itself must never break the CLI
                if debug_enabled(ctx):
                    raise
                click.secho(f"warning: plugin commands unavailable: {type(exc).__name__}: {exc}", fg="yellow", err=True)
            found = {n: c for n, c in collector.commands.items() if n not in self.commands}
            self._shadowed[manager] = sorted(n for n in collector.commands if n in self.commands)
            self._plugin_commands[manager] = found
        return found

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.commands) + sorted(self.plugin_commands(ctx))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        return self.plugin_commands(ctx).get(cmd_name)

    # -- error policy ------------------------------------------------------------------------
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:  # a bad top-level flag: one line too
            where = exc.ctx.command_path if exc.ctx is not None else (info_name or "omniloop")
            raise CliError(f"{exc.format_message()} (see '{where} --help')", exc.exit_code) from None
        except KeyboardInterrupt:  # Ctrl-C while plugins are discovered: 130 too, not click's "Aborted!" 1
            click.secho("interrupted", fg="yellow", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None

    def invoke(self, ctx: click.Context) -> Any:
        from omniloop.errors import OmniloopError

        try:
            return super().invoke(ctx)
        except CliError:
            raise
        except click.UsageError as exc:  # a subcommand's bad flag: one line, with where to look
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            raise CliError(f"{exc.format_message()} (see '{where} --help')", exc.exit_code) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.secho("interrupted", fg="yellow", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except OmniloopError as exc:
            if debug_enabled(ctx):
                raise
            raise CliError(str(exc), EXIT_USER_ERROR) from None
        except Exception as exc:
            if debug_enabled(ctx):
                raise
            raise CliError(
                f"{type(exc).__name__}: {exc} (run with --debug or OMNILOOP_DEBUG=1 for the traceback)",
                EXIT_INTERNAL_ERROR,
            ) from None


@click.group(cls=OmniloopGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for unexpected errors (also OMNILOOP_DEBUG=1).")
@click.version_option(package_name="omniloop-cli", prog_name="omniloop")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """omniloop: a plugin-oriented inference runtime for diffusion models.

    Plugins (model families, policies, interceptors, observers, schedulers) are separate
    packages discovered through the ``omniloop.plugins`` entry-point group; some add
    subcommands here.
    """
    ctx.obj = get_manager(ctx)


def main(argv: list[str] | None = None, **extra: Any) -> Any:
    """Console-script entry point. ``main(args, obj=manager)`` runs over a given plugin manager."""
    return cli.main(args=argv, prog_name="omniloop", **extra)
