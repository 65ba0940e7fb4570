"""Deliberately broken plugin packages, really installed (stevedore's way), never break the CLI.

A scratch venv gets five packages: one whose entry-point module raises ImportError, one that
declares a hook-API range this omniloop does not provide, one that calls ``sys.exit()`` at import
and one that calls it in a register hook (issue 14), and the toy family behind a real entry
point. Every command still works; only a deploy that names a broken plugin fails, loudly, naming
the entry point and the cause.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omniloop.hookspecs import HOOK_API_VERSION
from omniloop.testing import build_toy_checkpoint

pytestmark = pytest.mark.slow

BROKEN_IMPORT = '''
    raise ImportError("omniloop-broken-import needs libfoo, which is not installed")
'''

FUTURE_API = '''
    from omniloop.hookspecs import hookimpl

    OMNILOOP_HOOK_API = ">=9"


    @hookimpl
    def omniloop_register_families(register):
        raise AssertionError("a refused plugin's hooks are never called")
'''


EXIT_AT_IMPORT = '''
    import sys

    sys.exit(3)
'''

EXIT_IN_HOOK = '''
    import sys

    from omniloop.hookspecs import hookimpl

    OMNILOOP_HOOK_API = ">=1.0,<2"


    @hookimpl
    def omniloop_register_policies(register):
        sys.exit("policy registry unavailable")
'''


@pytest.fixture(scope="module")
def venv_with_broken_plugins(packaging: Any) -> Any:
    broken = packaging.package("omniloop-broken-import", "omniloop_broken_import",
                               {"broken-import": "omniloop_broken_import.plugin"}, {"plugin.py": BROKEN_IMPORT})
    future = packaging.package("omniloop-future-api", "omniloop_future_api",
                               {"future-api": "omniloop_future_api.plugin"}, {"plugin.py": FUTURE_API})
    exits = packaging.package("omniloop-exit-import", "omniloop_exit_import",
                              {"exit-import": "omniloop_exit_import.plugin"}, {"plugin.py": EXIT_AT_IMPORT})
    exits_hook = packaging.package("omniloop-exit-hook", "omniloop_exit_hook",
                                   {"exit-hook": "omniloop_exit_hook.plugin"}, {"plugin.py": EXIT_IN_HOOK})
    venv = packaging.venv("broken")
    venv.install(broken, future, exits, exits_hook, packaging.toy_package())
    return venv


def test_broken_plugins_are_listed_and_every_command_still_works(venv_with_broken_plugins: Any) -> None:
    venv = venv_with_broken_plugins
    res = venv.omniloop("plugins", "--json")
    assert res.returncode == 0, res.stderr
    plugins = {p["name"]: p for p in json.loads(res.stdout)["plugins"]}

    broken = plugins["broken-import"]
    assert broken["status"] == "failed"
    assert broken["distribution"] == "omniloop-broken-import"
    assert "ImportError" in broken["error"] and "libfoo" in broken["error"]

    future = plugins["future-api"]
    assert future["status"] == "refused"
    assert ">=9" in future["error"] and f"provides {HOOK_API_VERSION}" in future["error"]

    # issue 14: sys.exit() at import or in a register hook is one failed plugin, named
    exits = plugins["exit-import"]
    assert exits["status"] == "failed" and "SystemExit" in exits["error"] and "sys.exit(3)" in exits["error"]
    hook = plugins["exit-hook"]
    assert hook["status"] == "failed" and "SystemExit" in hook["error"] and "exit-hook" in hook["error"]
    assert "policy registry unavailable" in hook["error"]

    assert plugins["toy"]["status"] == "ok" and plugins["toy"]["provides"] == {"family": ["toy"]}
    assert plugins["core"]["status"] == "ok"

    table = venv.omniloop("plugins")
    assert table.returncode == 0, table.stderr
    assert "broken-import" in table.stdout and "libfoo" in table.stdout and "refused" in table.stdout

    for args in (["hooks"], ["generate", "--help"], ["--help"]):
        res = venv.omniloop(*args)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr
        assert res.stdout.strip(), args  # not the silent exit of issue 14


def test_generate_works_next_to_broken_plugins(venv_with_broken_plugins: Any, tmp_path: Path) -> None:
    ckpt = build_toy_checkpoint(tmp_path / "ckpt")
    res = venv_with_broken_plugins.omniloop(
        "generate", "a blue square", "--model", str(ckpt), "--steps", "2", "--out", str(tmp_path / "a.mp4"), "--json",
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["status"] == "completed"
    assert (tmp_path / "a.mp4").stat().st_size > 0


@pytest.mark.parametrize(
    ("plugin", "needles"),
    [
        ("broken-import", ["broken-import", "omniloop_broken_import.plugin", "ImportError", "libfoo"]),
        ("future-api", ["future-api", "omniloop_future_api.plugin", ">=9"]),
    ],
)
def test_a_deploy_naming_a_broken_plugin_is_a_hard_error(
    venv_with_broken_plugins: Any, tmp_path: Path, plugin: str, needles: list[str]
) -> None:
    ckpt = build_toy_checkpoint(tmp_path / "ckpt")
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(ckpt)}, "plugins": {plugin: {}}}))
    res = venv_with_broken_plugins.omniloop("generate", "x", "--deploy", str(deploy), "--out", str(tmp_path / "x.mp4"))
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0]
    assert not (tmp_path / "x.mp4").exists()
