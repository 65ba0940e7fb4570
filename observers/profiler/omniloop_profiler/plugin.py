"""Entry point ``profiler`` (group ``omniloop.plugins``): the profiler observer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.family import PluginComponentSpec, RunOptionSpec
from omniloop.hookspecs import hookimpl, registering
from omniloop.lazy import lazy_factory

from .config import ProfilerConfig

OMNILOOP_HOOK_API = ">=1.0,<2"

NAME = "profiler"

SPEC = PluginComponentSpec(
    name=NAME, kind="observer", factory=lazy_factory("omniloop_profiler.profiler", "make_profiler"),
    config_schema=ProfilerConfig,
    description="wall/device time per node, step and block; peak memory; torch.profiler window; NVTX",
)

omniloop_register_observers = registering(SPEC)


def _enable(deploy: Any, out: Path) -> Any:
    """The run's deploy with the profiler on, writing its JSON report beside the output file."""
    import attrs

    plugins = dict(deploy.plugins)
    plugins[NAME] = {**plugins.get(NAME, {}), "json": str(_report_path(out))}
    return attrs.evolve(deploy, plugins=plugins)


def _report_path(out: Path) -> Path:
    return out.with_name(out.stem + ".profile.json")


def _report(runtime: Any, output: Any, out: Path, quiet: bool) -> dict[str, Path]:
    """Print this request's per-node/step table; the JSON report was written by the observer."""
    from rich.console import Console

    from .summary import summary_table

    prof = runtime.components_enabled[NAME][1]
    report = prof.get_report(output.request_id)
    if report is None:
        return {}
    if not quiet:
        Console(soft_wrap=False).print(summary_table(report))
    return {"profile": _report_path(out)}


RUN_OPTION = RunOptionSpec(
    name="profile", enable=_enable, report=_report,
    help="Profile the run (omniloop-profiler): print a per-node/step table and write <out>.profile.json.",
)


@hookimpl
def omniloop_register_run_options(register: Any) -> None:
    register(RUN_OPTION)
