"""Route extensions: packages that add routes to ``omniloop serve``.

A package declares an entry point in the ``omniloop.server_routes`` group whose object is a
callable ``routes(api) -> list[starlette.routing.BaseRoute]`` (HTTP ``Route`` and
``WebSocketRoute`` alike). ``api`` is what the built-in endpoint modules use of the app: ``state``
(:class:`~omniloop_server.app.ServerState`: the runtime, the output folder, ``draining``,
``track(handles)`` so the shutdown drain waits for and cancels their engine requests), ``engine``
(the :class:`~omniloop_scheduler.AsyncEngine`: ``submit``, ``cancel``, ``forget``), and the body
and error helpers. Extension routes come after the built-in ones, so they cannot shadow them, and
run inside the same error guard (an exception becomes a 500 in OpenAI's shape, never a dropped
connection).

``omniloop serve`` mounts every installed extension; ``--no-<name>`` leaves one out (e.g.
``--no-comfyui``). ``create_app(..., route_extensions={name: routes})`` takes them explicitly
(tests); the default mounts none.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("omniloop.server")

GROUP = "omniloop.server_routes"
RouteExtension = Callable[[Any], list[Any]]


def installed() -> dict[str, md.EntryPoint]:
    """Installed extensions by name (not imported yet)."""
    return {ep.name: ep for ep in md.entry_points(group=GROUP)}


def load(disabled: frozenset[str] | set[str] = frozenset()) -> dict[str, RouteExtension]:
    """Import every installed extension not in ``disabled``; one that fails to import is logged and skipped."""
    out: dict[str, RouteExtension] = {}
    for name, ep in sorted(installed().items()):
        if name in disabled:
            continue
        try:
            out[name] = ep.load()
        except Exception as exc:  # a broken extension never stops the server
            log.warning("route extension %r (%s) failed to load: %s: %s", name, ep.value, type(exc).__name__, exc)
    return out


def mount(routes: list[Any], extensions: Mapping[str, RouteExtension] | None, api: Any) -> list[Any]:
    """The extension routes, after ``routes`` (the built-in ones win on a clash)."""
    extra: list[Any] = []
    for name, build in (extensions or {}).items():
        extra.extend(build(api))
        log.info("route extension %r mounted", name)
    return [*routes, *extra]
