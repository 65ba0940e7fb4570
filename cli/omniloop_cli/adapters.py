"""``omniloop adapters`` and ``generate --adapter NAME[=SCALE]`` (LoRA, issue 17).

``omniloop adapters --deploy FILE`` lists the adapters a deployment declares (name, file, size)
without loading the model; ``--load`` loads the deployment and shows each adapter as read and
matched against the model (layout, rank, modules). A request names adapters by the deploy's
names only (``--adapter style=0.8 --adapter detail``); an undeclared name is refused before the
model loads, with one line naming it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

from .app import cli, fail, get_manager


def parse_adapters(items: tuple[str, ...]) -> list[dict[str, Any]]:
    """``("style=0.8", "detail")`` -> ``[{"name": "style", "scale": 0.8}, {"name": "detail", "scale": 1.0}]``."""
    out: list[dict[str, Any]] = []
    for item in items:
        name, eq, scale = item.partition("=")
        if not name:
            fail(f"--adapter: expected NAME or NAME=SCALE, got {item[:40]!r}")
        value: Any = 1.0
        if eq:
            try:
                value = float(scale)
            except ValueError:
                fail(f"--adapter {name[:40]}: the scale must be a number, got {scale[:40]!r}")
            if not math.isfinite(value):
                fail(f"--adapter {name[:40]}: the scale must be a finite number")
        out.append({"name": name, "scale": value})
    return out


@cli.command("adapters")
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False), help="The deploy file declaring the adapters.")
@click.option("--model", "-m", help="A model preset name or checkpoint path (overrides the deploy file's).")
@click.option("--load", is_flag=True, help="Load the deployment and show each adapter as matched against the model.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.pass_context
def adapters_cmd(ctx: click.Context, deploy_file: str | None, model: str | None, load: bool, as_json: bool) -> None:
    """List the LoRA adapters a deployment declares (requests name them with --adapter NAME[=SCALE])."""
    from omniloop.runtime import Deployment, Runtime

    from .generate import build_deploy

    deploy = build_deploy(deploy_file, model, None, None)
    if load:
        rows = Runtime(deploy, manager=get_manager(ctx)).describe()["adapters"]
    else:
        Deployment(deploy, manager=get_manager(ctx))  # omniloop-adapters installed; names, files, the family's support
        rows = []
        for name, path in deploy.adapters.items():
            from omniloop_adapters import adapter_file  # installed: Deployment refuses adapters without it

            f = adapter_file(path)
            rows.append({"name": name, "path": str(f), "bytes": f.stat().st_size,
                         "fused": deploy.adapter_fuse.get(name)})
    if as_json:
        click.echo(json.dumps({"adapters": rows}, indent=2))
        return
    if not rows:
        click.echo("no adapters declared (deploy file: adapters: {NAME: PATH})")
        return
    for r in rows:
        extra = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("name", "path") and v is not None)
        click.echo(f"{r['name']}\t{r['path']}\t{extra}")


__all__ = ["adapters_cmd", "parse_adapters"]
