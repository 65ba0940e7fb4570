"""``omniloop comfy compile WORKFLOW.json [--deploy D]`` and ``omniloop comfy check WORKFLOW.json``.

Both read the API format or the editor format. ``compile`` prints the native request(s) as JSON
(one object per sampler chain: ``request`` and the save nodes it feeds); ``check`` prints one line
per node — ``mapped``, ``ignored`` (with the reason) or ``unsupported`` (with the error). Both exit
2 with one line on stderr when the graph cannot be compiled. Without ``--deploy`` loader names are
not checked and the family is read from the workflow (its loaders and latent nodes).
``--input-dir`` is where ``LoadImage`` names are read (without it an unbound compile leaves
``@input:<name>`` in the image's place). A request fed by another job's image holds
``@from-job:<node>`` there and lists it under ``inputs_from``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

PIPELINES = {"WanPipeline": "wan", "WanImageToVideoPipeline": "wan", "FluxPipeline": "flux",
             "StableDiffusion3Pipeline": "sd3"}


def _fail(message: str) -> Any:
    from omniloop_cli.app import fail

    fail(message)


def _target(deploy_path: Path | None, input_dir: Path | None) -> Any:
    import attrs

    from .compiler import Target

    target = target_from_deploy(deploy_path) if deploy_path is not None else Target()
    return attrs.evolve(target, input_dir=input_dir) if input_dir is not None else target


def target_from_deploy(path: Path) -> Any:
    """A :class:`~omniloop_comfyui.Target` from a deploy file (configs only, no weights)."""
    from omniloop.deploy import load_deploy
    from omniloop.errors import OmniloopError

    from .compiler import Target
    from .compiler import check_comfyui_section as check_section

    try:
        deploy = load_deploy(path)
    except OmniloopError as exc:
        _fail(str(exc))
    try:
        check_section(deploy.comfyui)
    except ValueError as exc:
        _fail(f"{path}: {exc}")
    m = deploy.model
    if m.path is None:
        _fail(f"{path}: model.path: `omniloop comfy` reads the checkpoint's configs; give the model's path")
    family = m.family
    if family is None:
        try:
            index = json.loads((Path(m.path) / "model_index.json").read_text(encoding="utf-8"))
            family = PIPELINES.get(index.get("_class_name"))
        except (OSError, ValueError):
            family = None
    if family is None:
        _fail(f"{path}: model.family: name the family (wan, flux, sd3); it could not be read from the checkpoint")
    try:
        return Target.from_checkpoint(m.path, model=m.preset or Path(str(m.path)).name, family=family,
                                      comfyui=deploy.comfyui, adapters=deploy.adapters.keys(),
                                      policies=deploy.policies)
    except ValueError as exc:
        _fail(f"{path}: {exc}")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _fail(f"{path}: cannot read the workflow: {exc}")


@click.group("comfy")
def comfy() -> None:
    """ComfyUI workflows: compile them to native requests, check their coverage."""


@comfy.command("compile")
@click.argument("workflow", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--deploy", "deploy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Match loader names against this deploy's model and its comfyui aliases.")
@click.option("--input-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Where LoadImage's file names are looked up (ComfyUI's input folder).")
def compile_cmd(workflow: Path, deploy_path: Path | None, input_dir: Path | None) -> None:
    """Print the native request(s) WORKFLOW compiles to (JSON)."""
    from .compiler import compile_workflow
    from .errors import WorkflowError

    target = _target(deploy_path, input_dir)
    try:
        out = compile_workflow(_read(workflow), target)
    except WorkflowError as exc:
        _fail(f"{workflow}: {exc.summary()}")
    click.echo(json.dumps([{"sampler_node": j.key, "request": j.request,
                            # request inputs another job's image fills ({index: that job's sampler node})
                            **({"inputs_from": {str(i): k for i, k in j.inputs_from.items()}} if j.inputs_from else {}),
                            "saves": [{"node_id": s.node_id, "class_type": s.class_type, "prefix": s.prefix, **s.options}
                                      for s in j.saves]} for j in out.jobs], indent=2, ensure_ascii=False))


@comfy.command("check")
@click.argument("workflow", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--deploy", "deploy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Match loader names against this deploy's model and its comfyui aliases.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--input-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Where LoadImage's file names are looked up (ComfyUI's input folder).")
def check_cmd(workflow: Path, deploy_path: Path | None, as_json: bool, input_dir: Path | None) -> None:
    """Coverage report: each node mapped / ignored (why) / unsupported (why)."""
    from .compiler import check_workflow
    from .errors import WorkflowError

    target = _target(deploy_path, input_dir)
    try:
        rows, err = check_workflow(_read(workflow), target)
    except WorkflowError as exc:  # not a graph at all
        _fail(f"{workflow}: {exc.summary()}")
    if as_json:
        click.echo(json.dumps({"compiles": err is None, "nodes": [
            {"node_id": r.node_id, "class_type": r.class_type, "status": r.status, "reason": r.reason} for r in rows]},
            indent=2, ensure_ascii=False))
    else:
        for r in rows:
            click.echo(f"{r.node_id:>10}  {r.class_type:<28} {r.status:<11} {r.reason}")
        counts = {s: sum(r.status == s for r in rows) for s in ("mapped", "ignored", "unsupported")}
        click.echo(f"{len(rows)} nodes: {counts['mapped']} mapped, {counts['ignored']} ignored, "
                   f"{counts['unsupported']} unsupported")
    if err is not None:
        _fail(f"{workflow}: does not compile: {err.summary()}")
