"""omniloop's OpenAI-style HTTP server (Starlette + uvicorn) over the async step engine."""

from .app import create_app

__all__ = ["create_app"]
