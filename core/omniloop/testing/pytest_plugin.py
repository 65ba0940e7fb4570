"""pytest fixtures for omniloop plugin authors (loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def toy_checkpoint(tmp_path: Path) -> Path:
    """A freshly built toy checkpoint directory."""
    from .toy import build_toy_checkpoint

    return build_toy_checkpoint(tmp_path / "toy-ckpt")


@pytest.fixture
def omniloop_manager() -> Any:
    """An isolated plugin manager (core + toy family + inline serial scheduler); no discovery."""
    from . import make_manager

    return make_manager()


@pytest.fixture
def toy_runtime_factory(toy_checkpoint: Path) -> Callable[..., Any]:
    """``toy_runtime_factory(("name", plugin_obj), ..., plugins={...deploy plugins...})``."""
    from . import toy_runtime

    def factory(*plugins: tuple[str, Any], **deploy: Any) -> Any:
        return toy_runtime(toy_checkpoint, *plugins, **deploy)

    return factory


@pytest.fixture
def toy_blocks() -> Any:
    """The toy block stack and steppable loop of :mod:`omniloop.testing.blocks` (for interceptor tests)."""
    from .blocks import blocks_namespace

    return blocks_namespace()
