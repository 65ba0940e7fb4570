"""Shared by the bench tests: bench/'s helper modules (``_sides``, ``_common``) imported as the bench
scripts import them, with bench/ on ``sys.path`` while they load."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_helper(name: str) -> ModuleType:
    """``bench/<name>.py`` imported (skips when this checkout has no bench/)."""
    if not (BENCH / f"{name}.py").exists():
        pytest.skip(f"bench/{name}.py not in this checkout")
    sys.path.insert(0, str(BENCH))
    try:
        import _repo_paths

        _repo_paths.add_repo_packages()
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def sides() -> ModuleType:
    """bench/_sides.py (the GPU benches' side names and runner)."""
    return bench_helper("_sides")


@pytest.fixture(scope="module")
def common() -> ModuleType:
    """bench/_common.py (timing, machine record, kernel profiles)."""
    return bench_helper("_common")
