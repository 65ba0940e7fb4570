"""Fixtures for the server tests: a real uvicorn server on 127.0.0.1 (ephemeral port) in a thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omniloop.testing import build_toy_checkpoint
from omniloop_scheduler.testing import Probe, ProbePlugin, make_runtime
from omniloop_server.testing import serving


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt")


#: the tiny checkpoints the SDK tests serve: family -> (package, builder arguments)
TINY_FAMILIES = {"flux": ("omniloop_flux", {"variant": "dev"}), "qwen": ("omniloop_qwen", {"arch": "qwen2"}),
                 "sd3": ("omniloop_sd3", {})}


@pytest.fixture(scope="session")
def tiny_family_runtime(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``tiny_family_runtime(family, **deploy)`` → a fresh CPU float32 runtime over the family's tiny
    checkpoint (``TINY_FAMILIES``; built once per session into a folder ``tiny-<family>``, the model
    name the server reports), with only that family and the real schedulers (serial, step)."""
    import importlib

    from omniloop.runtime import Runtime
    from omniloop_scheduler.testing import family_manager

    built: dict[str, Path] = {}

    def get(family: str, **deploy: Any) -> Any:
        package, build_args = TINY_FAMILIES[family]
        if family not in built:
            tiny = importlib.import_module(f"{package}.tiny")
            folder = tmp_path_factory.mktemp(f"sdk-{family}") / f"tiny-{family}"
            built[family] = tiny.build_tiny_checkpoint(folder, **build_args)
        manager = family_manager((family, importlib.import_module(f"{package}.plugin")), step=True)
        return Runtime.from_model(built[family], manager=manager, device="cpu", dtype="float32", **deploy)

    return get


@pytest.fixture
def probe_server(server_checkpoint: Path, tmp_path: Path) -> Iterator[tuple[str, Probe, Any]]:
    """A server over a toy runtime with the probe step interceptor (failure injection)."""
    from omniloop_server import create_app

    probe = Probe()
    rt = make_runtime(server_checkpoint, ("probe", ProbePlugin(probe)), plugins={"probe": {}},
                      scheduler="step", limits={"max_steps": 300, "max_queue": 64})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url:
        yield url, probe, app


@pytest.fixture
def server(server_checkpoint: Path, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    from omniloop_server import create_app

    rt = make_runtime(server_checkpoint, scheduler="step", limits={"max_steps": 300, "max_height": 64, "max_width": 64})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url:
        yield url, app
