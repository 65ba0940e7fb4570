"""Shared fixtures of the newcomer tests (issue 42): a plugin manager over the installed demo
presets and families only (no discovery of whatever else is installed), and the CLI contract."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_manager() -> Any:
    pytest.importorskip("diffusers")
    import omniloop_adapters.plugin as adapters_plugin
    import omniloop_cache_dit.plugin as cache_dit_plugin
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin
    import omniloop_policies.plugin as policies_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_wan.plugin as wan_plugin
    import omniloop_wan_demo.plugin as wan_demo_plugin
    from omniloop.testing import make_manager

    return make_manager(("wan", wan_plugin), ("wan-demo", wan_demo_plugin), ("flux", flux_plugin),
                        ("flux-demo", flux_demo_plugin), ("policies", policies_plugin),
                        ("scheduler", scheduler_plugin), ("cache-dit", cache_dit_plugin),
                        ("adapters", adapters_plugin),  # wan-demo-fast fuses its LoRA at load (issue 41)
                        toy=False, scheduler=False)


@pytest.fixture
def cli_run(demo_manager: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``cli_run(args)``: the CLI over the demo manager in a scratch working directory."""
    from click.testing import CliRunner

    from omniloop_cli import cli

    monkeypatch.chdir(tmp_path)

    def run(args: list[str]) -> Any:
        return CliRunner().invoke(cli, args, obj=demo_manager)

    return run


def one_error_line(res: Any) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def error_line() -> Any:
    return one_error_line
