"""pytest plugin (``pytest11`` entry point): ``--parity-regen`` and the ``parity_golden`` fixture."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("omniloop-parity")
    group.addoption(
        "--parity-regen",
        action="store_true",
        default=False,
        help="rewrite parity golden recordings instead of comparing against them (same as OMNILOOP_PARITY_REGEN=1)",
    )


def pytest_configure(config: Any) -> None:
    if config.getoption("--parity-regen", default=False):
        os.environ["OMNILOOP_PARITY_REGEN"] = "1"


@pytest.fixture
def parity_golden() -> Any:
    """``parity_golden(runtime, request, golden_path, tolerances=None, blocks=None)`` — assert parity in one line."""
    from .testing import assert_matches_golden

    return functools.partial(assert_matches_golden)
