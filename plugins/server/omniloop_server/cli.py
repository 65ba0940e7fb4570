"""``omniloop serve --deploy FILE [--host 127.0.0.1 --port 8000]``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from omniloop.errors import OmniloopError


def run_server(app: Any, host: str, port: int, log_level: str) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)


def make_serve_command(manager: Any = None) -> click.Command:
    """The ``serve`` command; ``manager`` (a PluginManager) is for tests, default: installed plugins."""

    @click.command("serve")
    @click.option("--deploy", "deploy_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
                  help="Deploy file (.yaml, .toml, .json): model, device, scheduler, plugins, limits.")
    @click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
    @click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to bind.")
    @click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="Where finished videos are written (default: a new temporary directory).")
    @click.option("--scheduler", type=click.Choice(["step", "serial"]), default=None,
                  help="Override the deploy's scheduler (default: the deploy's if step/serial, else step).")
    @click.option("--log-level", default="info", show_default=True,
                  type=click.Choice(["critical", "error", "warning", "info", "debug"]))
    def serve(deploy_path: Path, host: str, port: int, output_dir: Path | None, scheduler: str | None, log_level: str) -> None:
        """Serve a deployment over an OpenAI-style HTTP API (videos, images, models, health, metrics)."""
        from omniloop.runtime import Runtime

        from .app import create_app

        try:
            runtime = Runtime.from_deploy(deploy_path, manager=manager)
            app = create_app(runtime, output_dir=output_dir, scheduler=scheduler)
        except OmniloopError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"omniloop: serving {runtime.describe()['model']} on http://{host}:{port} "
                   f"(scheduler {app.state.omniloop.engine.scheduler}, outputs in {app.state.omniloop.jobs.output_dir})")
        run_server(app, host, port, log_level)

    return serve
