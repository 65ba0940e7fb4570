"""``omniloop serve --deploy FILE [--host 127.0.0.1 --port 8000]``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from omniloop.errors import OmniloopError

#: how long after the grace period uvicorn still waits for open connections (SSE streams end
#: when their job ends; cancelling takes one step)
CONNECTION_GRACE_S = 5.0


def shutdown_bound(shutdown_timeout: float) -> float:
    """The longest a shutdown takes: the grace period, the cancel landing and the last writes
    (the app's drain; a step that does not end is abandoned then), and the connections' last
    events (every SSE stream gets its final event before uvicorn closes it)."""
    from .app import STOP_GRACE_S, WRITE_GRACE_S

    return shutdown_timeout + STOP_GRACE_S + WRITE_GRACE_S + CONNECTION_GRACE_S


def guarded_protocol(max_connections: int, header_timeout_s: float, per_client: int | None = None) -> type:
    """uvicorn's h11 protocol with three guards: a connection beyond ``max_connections`` (HTTP and
    WebSocket together), or beyond ``per_client`` from one client address, is closed at once,
    before it holds a file descriptor for long; one whose first request's headers are not complete
    within ``header_timeout_s`` is closed (after a response, uvicorn's keep-alive timeout takes over)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    by_client: dict[str, int] = {}  # open HTTP connections per client address (one server per class)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: Any = None
        _counted: str | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if host is not None:
                by_client[host] = by_client.get(host, 0) + 1
                self._counted = host
            if len(self.connections) > max_connections or (
                    per_client is not None and host is not None and by_client[host] > per_client):
                transport.close()  # connection_lost forgets it
                return
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _uncount(self) -> None:
            if self._counted is not None:
                n = by_client.get(self._counted, 0) - 1
                if n > 0:
                    by_client[self._counted] = n
                else:
                    by_client.pop(self._counted, None)
                self._counted = None

        def handle_websocket_upgrade(self, event: Any) -> None:
            self._stop_timer()  # the socket belongs to the WebSocket protocol now (its own timeouts)
            self._uncount()  # (WebSockets count toward max_connections; their sessions are capped per client)
            super().handle_websocket_upgrade(event)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            self._uncount()
            super().connection_lost(exc)

    return GuardedH11Protocol


def run_server(app: Any, host: str, port: int, log_level: str, shutdown_timeout: float = 30.0) -> None:
    """Run ``app`` with uvicorn. On SIGTERM/SIGINT the app starts draining at once (no new jobs,
    in-flight jobs get ``shutdown_timeout`` seconds, then are cancelled; final states recorded),
    while uvicorn stops listening and waits for open connections (SSE clients) to end.

    Connection limits come from the deploy's ``server:`` options (:mod:`.options`): at most
    ``max_connections`` connections and WebSockets at once (more get closed / 503), idle
    keep-alive connections closed after ``keep_alive_timeout_s``, unfinished request headers after
    ``header_timeout_s``. The line ``omniloop: serving ... on http://HOST:PORT`` is printed once
    the socket is bound, with the real port (``--port 0`` picks a free one)."""
    import uvicorn

    state = app.state.omniloop
    opts = state.options

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = state.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(state.begin_drain)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            bound = [s.getsockname() for srv in getattr(self, "servers", []) for s in (srv.sockets or [])]
            real = bound[0][1] if bound else port
            shown = f"[{host}]" if ":" in host else host
            click.echo(f"omniloop: serving {state.model_id} on http://{shown}:{real} (scheduler "
                       f"{state.engine.scheduler}, outputs in {state.jobs.output_dir})")

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, round(shutdown_bound(shutdown_timeout))),
                            **connection_options(opts))
    _Server(config).run()


def connection_options(opts: Any) -> dict[str, Any]:
    """uvicorn ``Config`` arguments for the deploy's connection limits (:class:`.options.ServerOptions`)."""
    return {"http": guarded_protocol(opts.max_connections, opts.header_timeout_s, opts.max_connections_per_client),
            "limit_concurrency": opts.max_connections,
            "timeout_keep_alive": max(1, round(opts.keep_alive_timeout_s)),
            "ws_max_size": 1024 * 1024}


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
    @click.option("--public-url", default=None,
                  help="The server's public base URL (https://host[:port][/prefix]) for image 'url' answers; "
                       "default: the address of the socket a request came in on (never the Host header).")
    def serve(deploy_path: Path, host: str, port: int, output_dir: Path | None, scheduler: str | None, log_level: str,
              shutdown_timeout: float, public_url: str | None, **no_extension: bool) -> None:
        """Serve a deployment over an OpenAI-style HTTP API (videos, images, models, health, metrics).

        SIGTERM (or Ctrl-C): stop admitting jobs, let running ones finish for --shutdown-timeout
        seconds, cancel the rest, record each job's final state in OUTPUT_DIR/jobs.jsonl, exit."""
        from omniloop.runtime import Runtime

        from .app import create_app

        if public_url is not None and not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", public_url):
            raise click.BadParameter("expected http(s)://host[:port][/prefix]", param_hint="--public-url")
        try:
            from omniloop.deploy import check_in_process, load_deploy

            check_in_process(load_deploy(deploy_path), "omniloop serve")  # before any weights load
            runtime = Runtime.from_deploy(deploy_path, manager=manager)
            disabled = {name for name in extension_names if no_extension.get(_flag(name))}
            app = create_app(runtime, output_dir=output_dir, scheduler=scheduler, shutdown_timeout=shutdown_timeout,
                             route_extensions=load_extensions(disabled), public_url=public_url)
        except OmniloopError as exc:
            raise click.ClickException(str(exc)) from None
        run_server(app, host, port, log_level, shutdown_timeout)

    # one --no-<name> flag per installed route extension (omniloop.server_routes), e.g. --no-comfyui
    for name in extension_names:
        serve = click.option(f"--no-{name}", _flag(name), is_flag=True, default=False,
                             help=f"Do not mount the {name!r} routes (installed route extension).")(serve)
    return serve


def _flag(name: str) -> str:
    return "no_ext_" + "".join(ch if ch.isalnum() else "_" for ch in name)
