"""pytest fixtures for omniloop plugin authors (loaded through the ``pytest11`` entry point).

Triton kernels on a CPU machine: :data:`interpreted` marks tests that run a kernel in Triton's CPU
interpreter (they skip unless this process started with ``TRITON_INTERPRET=1``), and the
``run_interpreted_child`` fixture runs a test file's ``*_interpreted`` tests in a fresh pytest process
started with it (Triton picks the interpreter when it is first imported, so a process cannot switch).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: ``triton`` is importable here
HAS_TRITON = importlib.util.find_spec("triton") is not None
#: this process started under Triton's interpreter (set before triton's first import, as it must be)
IN_TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
#: a test that runs a Triton kernel in the interpreter: name it ``*_interpreted`` and let
#: ``run_interpreted_child`` run it in a child process
interpreted = pytest.mark.skipif(
    not (HAS_TRITON and IN_TRITON_INTERPRETER),
    reason="triton is not installed" if not HAS_TRITON else
    "runs in a child process started with TRITON_INTERPRET=1 (the file's run_interpreted_child test)",
)


@pytest.fixture
def run_interpreted_child() -> Callable[[str], None]:
    """``run(test_file)``: the file's ``*_interpreted`` tests in a fresh pytest process started with
    TRITON_INTERPRET=1; they must all pass and none may skip."""

    def run(test_file: str) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(Path(test_file)), "-q", "-k", "interpreted and not child_process",
             "-p", "no:cacheprovider", "-W", "ignore"],
            env=env, capture_output=True, text=True, timeout=900, check=False,
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
        assert proc.returncode == 0, tail
        assert " passed" in tail and "skipped" not in tail and "deselected" in tail, tail

    return run


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
def check_preset_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """``check_preset_not_installed(preset, [(module, "getter"), ...], *words)``: with each getter of
    the preset's weights folder patched to return an empty folder, ``Runtime.from_model(preset)`` is
    refused with one line (``DeployError``) naming the preset, "not installed" and each of ``words``
    (how to get the weights). Returns the message."""
    from ..errors import DeployError
    from ..runtime import Runtime

    def check(preset: str, getters: list[tuple[Any, str]], *words: str) -> str:
        empty = tmp_path / "checkpoint"
        empty.mkdir()
        for module, getter in getters:
            monkeypatch.setattr(module, getter, lambda: empty)
        with pytest.raises(DeployError) as err:
            Runtime.from_model(preset)
        msg = str(err.value)
        assert preset in msg and "not installed" in msg and "\n" not in msg, msg
        assert all(w in msg for w in words), msg
        return msg

    return check


@pytest.fixture
def toy_blocks() -> Any:
    """The toy block stack and steppable loop of :mod:`omniloop.testing.blocks` (for interceptor tests)."""
    from .blocks import blocks_namespace

    return blocks_namespace()


def family_fixtures(build: Callable[..., Path], prefix: str, make_runtime: Callable[..., Any],
                    make_reference: Callable[..., Any] | None = None, **defaults: Any) -> tuple[Any, Any, Any]:
    """The session fixtures of a family's test folder, declared once: bind the three returned
    fixtures to the names ``tiny_ckpt, runtime, reference`` in its ``conftest.py``.

    * ``tiny_ckpt(*values)`` → the path of ``build(folder, **arguments)`` (``defaults``: the builder's
      arguments in order, with their defaults), built once per arguments (:func:`~omniloop.testing.tiny_checkpoints`);
    * ``runtime(*values, step=False)`` → ``make_runtime(tiny_ckpt(*values), step=step)``, one per arguments;
    * ``reference(*values)`` → ``make_reference(tiny_ckpt(*values), *values)`` (the diffusers pipeline
      over the same files; its progress bar off), one per arguments.
    """
    from . import tiny_checkpoints

    def values_of(values: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(values) > len(defaults):
            raise TypeError(f"{prefix} checkpoints take at most {len(defaults)} arguments ({', '.join(defaults)})")
        return tuple({**defaults, **dict(zip(defaults, values, strict=False))}.values())

    @pytest.fixture(scope="session", name="tiny_ckpt")
    def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
        """``tiny_ckpt(*values)`` → path of a tiny checkpoint, built once per session (``family_fixtures``)."""
        return tiny_checkpoints(tmp_path_factory, build, prefix, **defaults)

    @pytest.fixture(scope="session", name="runtime")
    def runtime(tiny_ckpt: Callable[..., Path]) -> Callable[..., Any]:
        """``runtime(*values, step=False)`` → a CPU float32 runtime over ``tiny_ckpt(*values)`` (cached)."""
        done: dict[tuple[Any, ...], Any] = {}

        def get(*values: Any, step: bool = False) -> Any:
            key = (*values_of(values), step)
            if key not in done:
                done[key] = make_runtime(tiny_ckpt(*key[:-1]), step=step)
            return done[key]

        return get

    @pytest.fixture(scope="session", name="reference")
    def reference(tiny_ckpt: Callable[..., Path]) -> Callable[..., Any]:
        """``reference(*values)`` → the reference pipeline over ``tiny_ckpt(*values)`` (cached)."""
        if make_reference is None:
            raise pytest.UsageError(f"the {prefix} tests declare no reference pipeline")
        done: dict[tuple[Any, ...], Any] = {}

        def get(*values: Any) -> Any:
            key = values_of(values)
            if key not in done:
                done[key] = make_reference(tiny_ckpt(*key), *key)
                done[key].set_progress_bar_config(disable=True)
            return done[key]

        return get

    return tiny_ckpt, runtime, reference
