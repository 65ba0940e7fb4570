"""Built-in commands: ``plugins``, ``hooks``, ``schema`` (here), ``generate`` (:mod:`omniloop_cli.generate`),
``adapters`` (:mod:`omniloop_cli.adapters`) and ``models`` (:mod:`omniloop_cli.models`)."""

from __future__ import annotations

import json
from typing import Any

import click

from . import adapters as _adapters  # noqa: F401  (attaches ``omniloop adapters``)
from . import models as _models  # noqa: F401  (attaches ``omniloop models``)
from .app import OmniloopGroup, cli, get_manager
from .generate import generate


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    # created per call: click's test runner swaps sys.stdout / sys.stderr per invocation
    return Console(stderr=stderr, soft_wrap=False)


def _dist_version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
@click.pass_context
def plugins_cmd(ctx: click.Context, as_json: bool) -> None:
    """List discovered plugins: distribution, version, hook-API range, what each registers, status.

    A plugin that fails to import, declares an unsupported hook-API range, or fails inside a hook
    is listed with its error; it never breaks this command.
    """
    from omniloop.hookspecs import HOOK_API_VERSION

    manager = get_manager(ctx)
    manager.registry()  # calls the registration hooks: fills `provides`, marks failures
    group = ctx.find_root().command
    commands: list[str] = []
    if isinstance(group, OmniloopGroup):
        commands = sorted(group.plugin_commands(ctx))  # marks plugins whose command hook fails
    records = sorted(manager.records.values(), key=lambda r: (r.name != "core", r.name))
    for r in records:  # in-process plugins (core itself) are added without a version
        if r.distribution and not r.version:
            r.version = _dist_version(r.distribution)
    if as_json:
        click.echo(json.dumps({
            "hook_api_version": HOOK_API_VERSION,
            "plugins": [r.as_dict() for r in records],
            "commands": commands,
        }, indent=2))
        return

    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"omniloop plugins (hook API {HOOK_API_VERSION})", title_justify="left")
    for col in ("name", "distribution", "version", "hook API", "registers", "status"):
        table.add_column(col, overflow="fold")
    for r in records:
        provides = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(r.provides.items())) or "-"
        status = "[green]ok[/]" if r.ok else f"[red]{r.status}[/]: {escape(r.error or '')}"
        table.add_row(
            escape(r.name), escape(r.distribution or "-"), escape(r.version or "-"),
            escape(r.hook_api or "-"), escape(provides), status,
        )
    con = _console()
    con.print(table)
    if commands:
        con.print(f"plugin commands: {', '.join(commands)}")
    failed = [r for r in records if not r.ok]
    if failed:
        con.print(f"[yellow]{len(failed)} plugin(s) not loaded[/]; the others work normally.")


@cli.command("hooks")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--markdown", is_flag=True, help="Print the hooks reference (docs/hooks.md).")
def hooks_cmd(as_json: bool, markdown: bool) -> None:
    """List the hook points plugins implement, with signatures and the version each exists since."""
    from omniloop.hookspecs import HOOK_API_VERSION

    from .hookdocs import hook_points, render_markdown

    if markdown:
        click.echo(render_markdown(), nl=False)
        return
    points = hook_points()
    if as_json:
        click.echo(json.dumps({
            "hook_api_version": HOOK_API_VERSION, "hooks": [p.as_dict() for p in points],
        }, indent=2))
        return

    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"omniloop hooks (hook API {HOOK_API_VERSION})", title_justify="left")
    table.add_column("kind")
    table.add_column("hook", overflow="fold")
    table.add_column("since")
    table.add_column("what", overflow="fold")
    for p in points:
        table.add_row(p.kind, escape(p.signature), p.since or "?", escape(p.summary))
    _console().print(table)


@cli.command("schema")
@click.option("--model", "-m", help="Also the node parameters of this model's pipeline (a preset or a checkpoint path).")
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False), help="A deploy file (instead of --model).")
@click.option("--task", help="The pipeline whose node parameters to show (default: every task the model supports).")
@click.pass_context
def schema_cmd(ctx: click.Context, model: str | None, deploy_file: str | None, task: str | None) -> None:
    """Print the JSON Schema (2020-12) of a request, generated from the schema's attrs classes.

    Also the parameter schemas of every installed policy and plugin (``plugin_params.<name>``),
    and with --model/--deploy the node parameters of that model's pipelines (``node_params.<node>``,
    read from its config files when the family can build a pipeline without weights)."""
    from omniloop_io.jsonschema import json_schema, request_schema

    manager = get_manager(ctx)
    reg = manager.registry()
    doc: dict[str, Any] = {"request": request_schema(), "plugin_params": {}, "policy_params": {}}
    for name, spec in sorted({**reg.interceptors, **reg.observers}.items()):
        if spec.params_schema is not None:
            doc["plugin_params"][name] = json_schema(spec.params_schema)
    for spec in reg.policies.values():
        if spec.params_schema is not None:
            doc["policy_params"].setdefault(spec.params_schema.__name__, json_schema(spec.params_schema))
    if model or deploy_file:
        doc["node_params"] = _node_param_schemas(manager, model, deploy_file, task)
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


def _node_param_schemas(manager: Any, model: str | None, deploy_file: str | None, task: str | None) -> dict[str, Any]:
    from omniloop.request import TaskType
    from omniloop.runtime import Deployment, Runtime
    from omniloop_io.jsonschema import json_schema

    from .generate import build_deploy

    deploy = build_deploy(deploy_file, model, None, None)
    dep: Any = Deployment(deploy, manager=manager)
    model_obj = dep.inspect()
    if model_obj is None and not task:
        # without a config-only view the family's task list is all that is known: a T2V checkpoint
        # of a family that also does I2V would be asked for I2V; the loaded model says what it does
        dep = Runtime(deploy, manager=manager)
    tasks = [TaskType(task)] if task else sorted(dep.supported_tasks, key=lambda t: t.value)
    out: dict[str, Any] = {}
    for t in tasks:
        spec = dep._config_pipeline(model_obj, t) if model_obj is not None else None
        if spec is None:  # the family needs its components to build the pipeline
            dep = dep if isinstance(dep, Runtime) else Runtime(deploy, manager=manager)
            spec = dep.pipeline(t).spec
        out[t.value] = {n.name: json_schema(n.params_schema) for n in spec.nodes if n.params_schema is not None}
    return out


cli.add_command(generate)
