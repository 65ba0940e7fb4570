"""A fast start (issue 42): ``omniloop --help`` and loading every installed plugin's entry point
import no torch (nor diffusers, transformers, starlette). Checked in fresh interpreters through
``sys.modules``, not by timing (the seconds are measured by ``bench/fast_start.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers", "starlette", "uvicorn", "av", "numpy")


def _heavy_after(code: str) -> list[str]:
    probe = code + f"\nimport json, sys\nprint('HEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("HEAVY=")][-1]
    return json.loads(line[len("HEAVY="):])


def test_omniloop_help_imports_no_torch():
    code = (
        "import sys\nfrom omniloop_cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
    )
    assert _heavy_after(code) == []


def test_the_help_still_lists_plugin_commands():
    res = subprocess.run([sys.executable, "-m", "omniloop_cli", "--help"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "serve" in res.stdout and "generate" in res.stdout  # a plugin's command and a built-in one


def test_importing_the_core_package_and_request_types_imports_no_torch():
    assert _heavy_after("import omniloop\nfrom omniloop.request import OmniRequest\nfrom omniloop import TaskType") == []


def test_loading_every_installed_plugin_entry_point_imports_no_torch():
    """Registration must be cheap (CONTRIBUTING, "Writing a plugin"): each plugin module defers its
    heavy imports to the hooks that need them."""
    code = (
        "import importlib.metadata as md\n"
        "for ep in md.entry_points(group='omniloop.plugins'):\n"
        "    ep.load()\n"
    )
    assert _heavy_after(code) == []


def test_the_lazy_package_exports_still_resolve():
    pytest.importorskip("torch")
    import omniloop

    missing = [n for n in omniloop.__all__ if getattr(omniloop, n, None) is None]
    assert missing == []
    assert omniloop.runtime.Runtime is omniloop.Runtime  # a submodule as an attribute, as before
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        omniloop.nope  # noqa: B018
