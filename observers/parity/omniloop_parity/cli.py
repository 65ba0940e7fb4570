"""``omniloop parity record|compare|replay|show`` — added to the ``omniloop`` CLI by the plugin.

Exit status: 0 parity holds, 1 it does not, 2 bad input (missing file, bad flags, a run that
failed). The plugin manager is the root click context object, as ``omniloop-cli`` sets it
(``CliRunner().invoke(parity_group, args, obj=manager)`` in tests); default: the installed plugins.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from omniloop.errors import OmniloopError

from .compare import Tolerances


class ParityUsageError(click.ClickException):
    """Bad input: one red line on stderr (as omniloop-cli prints errors), exit status 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.secho(f"error: {' '.join(self.format_message().split())}", fg="red", err=True)


def _console() -> Console:
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=max(100, Console().width))


def _err_console() -> Console:
    return Console(file=sys.stderr, highlight=False)


def _manager(ctx: click.Context) -> Any:
    """The plugin manager of this CLI run: the root context object (omniloop-cli sets it), else None."""
    from omniloop.plugins import PluginManager

    obj = ctx.find_root().obj
    if isinstance(obj, PluginManager):
        return obj
    if isinstance(obj, dict):
        return obj.get("plugin_manager")
    return None


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except OmniloopError as exc:
        raise ParityUsageError(str(exc)) from None


@contextmanager
def _progress(enabled: bool, label: str) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn(f"[bold]{label}[/] {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_err_console(),
        transient=True,
    )
    tasks: dict[str, Any] = {}

    def update(node: str, step: int, total: int) -> None:
        if node not in tasks:
            tasks[node] = bar.add_task(node, total=total)
        bar.update(tasks[node], completed=step, total=total)

    with bar:
        yield update


class FiniteFloat(click.FloatRange):
    """A ``click.FloatRange`` that also refuses ``nan`` and ``inf`` (click lets both through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        v = super().convert(value, param, ctx)
        if v is not None and not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def _tolerances(atol: float | None, rtol: float | None, cos: float | None, path: str | None) -> Tolerances:
    tols = Tolerances.from_toml(path) if path else Tolerances()
    return tols.with_default(atol=atol, rtol=rtol, cos=cos)


def tolerance_options(f: Any) -> Any:
    f = click.option(
        "--tolerances",
        "tol_file",
        type=click.Path(dir_okay=False),
        help="TOML file: top-level atol/rtol/cos and [[override]] tables {match=GLOB, atol=...}.",
    )(f)
    f = click.option("--cos", type=FiniteFloat(0, 1), default=None, help="Minimum cosine similarity per tap.")(f)
    f = click.option("--rtol", type=FiniteFloat(min=0), default=None, help="Relative tolerance (default 0).")(f)
    f = click.option("--atol", type=FiniteFloat(min=0), default=None, help="Absolute tolerance (default 0).")(f)
    return f


def _print_result(result: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, default=str))
        return
    from .report import result_renderable

    _console().print(result_renderable(result))


@click.group("parity")
def parity_group() -> None:
    """Record runs as named taps, compare two runs, find the first divergence."""


@parity_group.command("record")
@click.argument("prompt")
@click.option("--model", "-m", help="Model preset name or checkpoint path.")
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False), help="Deploy config file.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Recording to write (.safetensors).")
@click.option("--task", default="t2v", show_default=True, help="Task (t2v, i2v, t2i, ...).")
@click.option("--negative-prompt", default=None)
@click.option("--image", type=click.Path(exists=True, dir_okay=False), default=None, help="Input image (i2v).")
@click.option("--steps", type=click.IntRange(min=1), default=None)
@click.option("--guidance-scale", type=FiniteFloat(min=0), default=None)
@click.option("--shift", type=FiniteFloat(min=0, min_open=True), default=None)
@click.option("--height", type=click.IntRange(min=1), default=None)
@click.option("--width", type=click.IntRange(min=1), default=None)
@click.option("--frames", type=click.IntRange(min=1), default=None)
@click.option("--fps", type=FiniteFloat(min=0, min_open=True), default=None)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--device", default=None, help="Device (default: the deploy's, else cpu).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--taps", default=None, help="Regex of tap names to record (default: all).")
@click.option(
    "--blocks",
    default=None,
    help="Regex of block names whose outputs to record, e.g. 'blocks\\.(0|5)$' (forces eager block execution).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
def record_cmd(
    ctx: click.Context,
    prompt: str,
    model: str | None,
    deploy_file: str | None,
    out: str,
    task: str,
    negative_prompt: str | None,
    image: str | None,
    steps: int | None,
    guidance_scale: float | None,
    shift: float | None,
    height: int | None,
    width: int | None,
    frames: int | None,
    fps: float | None,
    seed: int,
    device: str | None,
    dtype: str | None,
    taps: str | None,
    blocks: str | None,
    no_progress: bool,
) -> None:
    """Run PROMPT and record its taps into OUT.

    The request, the deployment and OUT are checked before the model loads."""
    import attrs

    from omniloop.deploy import load_deploy
    from omniloop.plugins import default_manager
    from omniloop.runtime import Deployment
    from omniloop.schema import request_from_dict
    from omniloop_io.media import check_writable

    from .run import _ensure_plugin, model_fields, record, runtime_with_parity, with_parity

    if model is None and deploy_file is None:
        raise ParityUsageError("give --model or --deploy")
    with _errors():
        if deploy_file is not None:
            cfg = load_deploy(deploy_file)
            if model is not None:
                cfg = attrs.evolve(cfg, model=attrs.evolve(cfg.model, **model_fields(model)))
        else:
            assert model is not None
            cfg = load_deploy({"model": model_fields(model)})
        changes = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if changes:
            cfg = attrs.evolve(cfg, **changes)
        given = dict(steps=steps, guidance_scale=guidance_scale, shift=shift, height=height, width=width,
                     frames=frames, fps=fps, seed=seed)
        diffusion = {k: v for k, v in given.items() if v is not None}
        data: dict[str, Any] = {"task": task, "prompt": prompt, "diffusion": diffusion}
        if negative_prompt is not None:
            data["negative_prompt"] = negative_prompt
        if image is not None:
            data["inputs"] = [{"type": "image", "path": str(Path(image).resolve())}]
        request = request_from_dict(data)
        check_writable(out)
        manager = _manager(ctx) or default_manager()
        _ensure_plugin(manager)
        Deployment(with_parity(cfg, taps=taps, blocks=blocks), manager=manager).check(request)
        rt = runtime_with_parity(deploy=cfg, plugins=manager, taps=taps, blocks=blocks)
        with _progress(not no_progress, "recording") as progress:
            rec = record(rt, data, out=out, progress=progress)
    size = Path(out).stat().st_size
    _err_console().print(f"[green]recorded[/] {len(rec)} taps to {escape(out)} ({size / 1e6:.2f} MB)")


@parity_group.command("compare")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@tolerance_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def compare_cmd(
    ctx: click.Context,
    a: str,
    b: str,
    atol: float | None,
    rtol: float | None,
    cos: float | None,
    tol_file: str | None,
    as_json: bool,
) -> None:
    """Compare recording B against reference A; exit 0 if they match within tolerance, 1 if not."""
    from .compare import compare

    with _errors():
        result = compare(a, b, _tolerances(atol, rtol, cos, tol_file))
    _print_result(result, as_json)
    ctx.exit(0 if result.passed else 1)


@parity_group.command("replay")
@click.argument("recording", type=click.Path(dir_okay=False))
@click.option("--model", "-m", help="Model preset or path (default: the recording's deploy).")
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False), help="Deploy config file.")
@click.option("--device", default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None, help="Also save the new recording here.")
@tolerance_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
def replay_cmd(
    ctx: click.Context,
    recording: str,
    model: str | None,
    deploy_file: str | None,
    device: str | None,
    dtype: str | None,
    out: str | None,
    atol: float | None,
    rtol: float | None,
    cos: float | None,
    tol_file: str | None,
    as_json: bool,
    no_progress: bool,
) -> None:
    """Run RECORDING's request again and compare against it (exit 0 match, 1 divergence)."""
    from .run import replay

    with _errors():
        tols = _tolerances(atol, rtol, cos, tol_file)
        with _progress(not no_progress and not as_json, "replaying") as progress:
            result, _ = replay(
                recording,
                model=model,
                deploy=deploy_file,
                plugins=_manager(ctx),
                device=device,
                dtype=dtype,
                tolerances=tols,
                out=out,
                progress=progress,
            )
    _print_result(result, as_json)
    ctx.exit(0 if result.passed else 1)


@parity_group.command("show")
@click.argument("recording", type=click.Path(dir_okay=False))
@click.option("--all", "all_taps", is_flag=True, help="List every tap with its statistics.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def show_cmd(recording: str, all_taps: bool, as_json: bool) -> None:
    """Describe a recording: request, environment, taps per step."""
    from .recording import Recording
    from .report import recording_renderable

    with _errors():
        rec = Recording.load(recording)
    if as_json:
        click.echo(json.dumps(rec.manifest, indent=1, default=str))
        return
    _console().print(recording_renderable(rec, all_taps=all_taps))
