"""``omniloop serve --deploy FILE [--host 127.0.0.1 --port 8000]``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from omniloop.errors import OmniloopError

#: how long after the grace period uvicorn still waits for open connections (SSE streams end
#: when their job ends; cancelling takes one step)
CONNECTION_GRACE_S = 5.0


def run_server(app: Any, host: str, port: int, log_level: str, shutdown_timeout: float = 30.0) -> None:
    """Run ``app`` with uvicorn. On SIGTERM/SIGINT the app starts draining at once (no new jobs,
    in-flight jobs get ``shutdown_timeout`` seconds, then are cancelled; final states recorded),
    while uvicorn stops listening and waits for open connections (SSE clients) to end."""
    import uvicorn

    state = app.state.omniloop

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = state.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(state.begin_drain)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, round(shutdown_timeout + CONNECTION_GRACE_S)))
    _Server(config).run()


def make_serve_command(manager: Any = None) -> click.Command:
    """The ``serve`` command; ``manager`` (a PluginManager) is for tests, default: installed plugins."""

    from .extensions import installed
    from .extensions import load as load_extensions

    extension_names = sorted(installed())

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
    @click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(0, 86400),
                  help="On SIGTERM/SIGINT: seconds running jobs may still finish before they are cancelled "
                       "(new jobs get 503 at once; every job's final state goes to OUTPUT_DIR/jobs.jsonl).")
    def serve(deploy_path: Path, host: str, port: int, output_dir: Path | None, scheduler: str | None, log_level: str,
              shutdown_timeout: float, **no_extension: bool) -> None:
        """Serve a deployment over an OpenAI-style HTTP API (videos, images, models, health, metrics).

        SIGTERM (or Ctrl-C): stop admitting jobs, let running ones finish for --shutdown-timeout
        seconds, cancel the rest, record each job's final state in OUTPUT_DIR/jobs.jsonl, exit."""
        from omniloop.runtime import Runtime

        from .app import create_app

        try:
            from omniloop.deploy import check_in_process, load_deploy

            check_in_process(load_deploy(deploy_path), "omniloop serve")  # before any weights load
            runtime = Runtime.from_deploy(deploy_path, manager=manager)
            disabled = {name for name in extension_names if no_extension.get(_flag(name))}
            app = create_app(runtime, output_dir=output_dir, scheduler=scheduler, shutdown_timeout=shutdown_timeout,
                             route_extensions=load_extensions(disabled))
        except OmniloopError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"omniloop: serving {runtime.describe()['model']} on http://{host}:{port} "
                   f"(scheduler {app.state.omniloop.engine.scheduler}, outputs in {app.state.omniloop.jobs.output_dir})")
        run_server(app, host, port, log_level, shutdown_timeout)

    # one --no-<name> flag per installed route extension (omniloop.server_routes), e.g. --no-comfyui
    for name in extension_names:
        serve = click.option(f"--no-{name}", _flag(name), is_flag=True, default=False,
                             help=f"Do not mount the {name!r} routes (installed route extension).")(serve)
    return serve


def _flag(name: str) -> str:
    return "no_ext_" + "".join(ch if ch.isalnum() else "_" for ch in name)
