"""``omniloop models``: the model presets and families installed, what each does and what it needs.

Presets (``--model wan-demo``) come with their weights; a family (``--model /path/to/folder``)
needs a checkpoint folder you download on a connected machine (docs/using-real-weights.md). For
each preset: its family, the tasks its checkpoint does, the range it supports (its omniloop.json
``limits``, see :mod:`omniloop.limits`) and its default size; for each family: its tasks and the
checkpoints it loads. Nothing is loaded: the checks are the weight-free ``Deployment`` ones.
"""

from __future__ import annotations

import json
import re
from typing import Any

import click

from .app import cli, get_manager

#: what each family shipped in this repo loads, and where such weights come from (documentation,
#: shown as is; a family installed from elsewhere shows "-": see its README)
FAMILY_WEIGHTS = {
    "wan": "a diffusers-format Wan 2.1 / 2.2 folder, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    "flux": "a diffusers-format FLUX.1 folder, e.g. black-forest-labs/FLUX.1-schnell",
    "sd3": "a diffusers-format SD3 / 3.5 folder, e.g. stabilityai/stable-diffusion-3.5-medium",
    "qwen": "a transformers-format Qwen2 / 2.5 / 3 folder, e.g. Qwen/Qwen2.5-0.5B-Instruct",
    "stable-audio": "a diffusers-format Stable Audio Open folder, e.g. stabilityai/stable-audio-open-1.0",
}
DOCS = "docs/using-real-weights.md"


def _range(lim: Any, name: str) -> str:
    lo = getattr(lim, f"min_{name}", None) if lim is not None else None
    hi = getattr(lim, f"max_{name}", None) if lim is not None else None
    if lo is not None and hi is not None:
        return str(hi) if lo == hi else f"{lo}-{hi}"
    return f"<={hi}" if hi is not None else "-"


def _short(preset: dict[str, Any]) -> str:
    """An unavailable preset's problem for the table: its first clause, without the ``model: preset
    'name': `` prefix (``--json`` and ``omniloop generate --model NAME`` give the whole message)."""
    text = str(preset["problem"]).removeprefix(f"model: preset {preset['name']!r}: ")
    first = re.split(r"; | \(", text, maxsplit=1)[0]
    return first if first == text else f"{first} (omniloop generate --model {preset['name']} says how to fix it)"


def describe_models(manager: Any) -> dict[str, Any]:
    """Presets and families as plain data (``omniloop models --json``)."""
    from omniloop.errors import OmniloopError
    from omniloop.runtime import Deployment

    reg = manager.registry()
    presets = []
    for name, preset in sorted(reg.presets.items()):
        row: dict[str, Any] = {"name": name, "family": preset.family, "description": preset.description}
        try:
            dep = Deployment({"model": {"preset": name}}, manager=manager)
        except OmniloopError as exc:  # e.g. weights not installed: say why, list the rest
            row.update(available=False, problem=str(exc))
            presets.append(row)
            continue
        lim = dep.deploy.limits
        row.update(
            available=True, path=str(dep.model_path), tasks=sorted(t.value for t in dep.supported_tasks),
            limits={"height": _range(dep.model_limits, "height"), "width": _range(dep.model_limits, "width"),
                    "frames": _range(dep.model_limits, "frames"), "max_steps": lim.max_steps,
                    "enforce": dep.model_limits.enforce if dep.model_limits is not None else None,
                    "note": dep.model_limits.note if dep.model_limits is not None else None},
            weights="shipped with the package",
        )
        presets.append(row)
    families = [
        {"name": name, "tasks": sorted(t.value for t in fam.tasks),
         "weights": FAMILY_WEIGHTS.get(name, "-"), "how": DOCS if name in FAMILY_WEIGHTS else None}
        for name, fam in sorted(reg.families.items())
    ]
    return {"presets": presets, "families": families}


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
@click.pass_context
def models_cmd(ctx: click.Context, as_json: bool) -> None:
    """List model presets (weights included) and installed families (weights you fetch).

    Presets: family, tasks, the size/frame range the checkpoint supports, its note. Families: tasks
    and which checkpoint folders they load (how to get them: docs/using-real-weights.md)."""
    doc = describe_models(get_manager(ctx))
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(soft_wrap=False)
    t = Table(title="model presets: omniloop generate PROMPT --model NAME", title_justify="left")
    t.add_column("preset", no_wrap=True)
    for col in ("family", "tasks", "height", "width", "frames", "note"):
        t.add_column(col, overflow="fold")
    for p in doc["presets"]:
        if not p["available"]:
            t.add_row(escape(p["name"]), escape(p["family"]), "-", "-", "-", "-", f"[red]unavailable[/]: {escape(_short(p))}")
            continue
        lim = p["limits"]
        t.add_row(escape(p["name"]), escape(p["family"]), ", ".join(p["tasks"]), lim["height"], lim["width"],
                  lim["frames"], escape(lim["note"] or p["description"]))
    con.print(t)
    f = Table(title=f"families: --model /path/to/checkpoint (weights: {DOCS})", title_justify="left")
    f.add_column("family", no_wrap=True)
    for col in ("tasks", "loads"):
        f.add_column(col, overflow="fold")
    for fam in doc["families"]:
        f.add_row(escape(fam["name"]), ", ".join(fam["tasks"]), escape(fam["weights"]))
    con.print(f)
