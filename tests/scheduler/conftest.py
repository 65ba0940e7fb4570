"""Fixtures for the scheduler tests (helpers: omniloop_scheduler.testing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.runtime import Runtime
from omniloop.testing import build_toy_checkpoint
from omniloop_scheduler.testing import Probe, ProbePlugin, make_runtime


@pytest.fixture(scope="session")
def sched_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt")


@pytest.fixture(scope="session")
def runtime(sched_checkpoint: Path) -> Runtime:
    return make_runtime(sched_checkpoint)


@pytest.fixture
def probe_runtime(sched_checkpoint: Path) -> tuple[Runtime, Probe]:
    probe = Probe()
    rt = make_runtime(sched_checkpoint, ("probe", ProbePlugin(probe)), plugins={"probe": {}})
    return rt, probe
