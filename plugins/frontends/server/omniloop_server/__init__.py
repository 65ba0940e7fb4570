"""omniloop's OpenAI-style HTTP server (Starlette + uvicorn) over the async step engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # the app (starlette, the scheduler, torch) imports on first use: ``omniloop --help`` adds the
    # ``serve`` command from omniloop_server.cli without it (issue 42)
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
