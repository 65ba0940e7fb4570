"""``omniloop eval adherence``: prompt adherence of a model on the demo prompts.

    omniloop eval adherence --model wan-demo --steps 20 --seeds 0,1
    omniloop eval adherence --steps 50,20,8,4 --prompts full --json adherence.json
    omniloop eval adherence --model wan-demo-causal --steps 4,8      # streamed clips (rollout: causal)
    omniloop eval adherence --model flux-demo                        # an image model: color, shape, position
    omniloop eval adherence --model tone-demo                        # an audio model: timbre, pitch, rhythm
    omniloop eval compare bf16.json fp8.json                         # verdicts lost / gained, McNemar p
    omniloop eval adherence --model flux-demo --deploy fast.yaml     # what a deployment's settings cost

``--deploy FILE`` evaluates the runtime under a deploy file's settings (``compile``, ``attention_backend``,
family ``options``, ``linear_precision``, plugins ...) so that ``eval compare`` can say what a fast path
costs in adherence; ``--model``, ``--device`` and ``--dtype`` choose the model, as they override a deploy
file in ``omniloop generate``.

A video model is scored on color, direction and shape; a checkpoint whose ``omniloop.json`` holds
``"adherence": {"kind": "image"}`` is an image model: image prompts (``a {color} {shape} at the
{position}``) go through the runtime as ``t2i`` requests and color, shape and position are scored.
``"adherence": {"kind": "audio"}`` (tone-demo) hands the checkpoint to omniloop-tone-demo's
evaluator (timbre, pitch, rhythm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape


def _ints(value: str) -> list[int]:
    return [int(v) for v in str(value).replace(" ", "").split(",") if v]


@click.command("adherence")
@click.option("--model", default="wan-demo", show_default=True, help="preset name or checkpoint folder")
@click.option("--steps", default=None, help="denoising steps; a comma list sweeps (default: the checkpoint's, 20)")
@click.option("--seeds", default="0,1", show_default=True, help="comma-separated seeds")
@click.option("--guidance", "guidance_scale", default=None, type=float, help="CFG scale (default: the checkpoint's omniloop.json defaults.guidance_scale: 2.0 for wan-demo, 1.0 for wan-demo-fast)")
@click.option("--prompts", "prompt_set", default="default", type=click.Choice(["default", "full"]), show_default=True,
              help="video: default 6 colors x 4 directions, shapes rotating (24), full x 4 shapes (96); "
              "image: default 6 colors x 9 positions, shapes rotating (54), full x 4 shapes (216)")
@click.option("--backend", default="auto", type=click.Choice(["auto", "runtime", "diffusers"]), show_default=True,
              help="auto: omniloop's runtime when it can load the model, else diffusers' WanPipeline")
@click.option("--rollout", default="auto", type=click.Choice(["auto", "bidirectional", "causal"]), show_default=True,
              help="causal: score streamed clips (Runtime.stream, PARTIAL chunks; steps are per chunk); "
              "auto: causal for a checkpoint whose omniloop.json says rollout: causal (wan-demo-causal)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--batch-size", default=48, show_default=True, type=int)
@click.option("--linear-precision", default="dtype", show_default=True,
              help="the runtime deployment's linear_precision (fp8: omniloop-quant's FP8 block linears), to measure "
              "what a precision costs in adherence; the runtime backend only")
@click.option("--deploy", "deploy_file", default=None, type=click.Path(dir_okay=False),
              help="a deploy file (.yaml/.toml/.json) whose settings the runtime under test gets (compile, "
              "attention_backend, options, ...); --model/--device/--dtype still choose the model; the runtime backend only")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False), help="write the full report here")
@click.option("--table/--no-table", default=True, show_default=True, help="print the per-clip table")
def adherence(model: str, steps: str | None, seeds: str, guidance_scale: float | None, prompt_set: str, backend: str,
              rollout: str, device: str, dtype: str, batch_size: int, linear_precision: str, deploy_file: str | None,
              json_out: str | None, table: bool) -> None:
    """Generate a fixed set of prompts x seeds, detect color, shape and motion direction (video) or
    position (image), report accuracy with 95 % Wilson intervals."""
    from rich.console import Console
    from rich.table import Table

    from omniloop.errors import DeployError

    from .evaluate import adherence_kind, evaluate, format_table, table_columns, wilson
    from .evaluate import prompt_set as prompts_of

    console = Console()
    meta = _checkpoint_meta(model)
    block = meta.get("adherence")
    deploy = deploy_settings(deploy_file)
    if linear_precision != "dtype":
        deploy["linear_precision"] = linear_precision
    flags = " / ".join(f for f, given in (("--deploy", deploy_file), ("--linear-precision", linear_precision != "dtype"))
                       if given)
    if deploy and backend == "diffusers":
        raise click.UsageError(f"{flags}: runtime deployment settings; --backend diffusers runs diffusers' "
                               "pipeline as it is")
    if isinstance(block, dict) and block.get("kind") == "audio":
        if deploy:
            raise click.UsageError(f"{flags}: not wired for audio models ({model})")
        _audio(model, steps=steps, seeds=seeds, guidance_scale=guidance_scale, prompt_set=prompt_set, backend=backend,
               rollout=rollout, device=device, dtype=dtype, batch_size=batch_size, json_out=json_out, table=table)
        return
    try:
        kind = adherence_kind(meta)
    except ValueError as e:
        raise click.UsageError(f"--model {model}: {e}") from None
    defaults = dict(meta.get("defaults") or {})
    step_list = _ints(steps) if steps else [int(defaults.get("steps", 20))]
    g = guidance_scale if guidance_scale is not None else float(defaults.get("guidance_scale", 5.0 if kind == "video" else 3.5))
    if kind == "image":
        if rollout == "causal":
            raise click.UsageError(f"--rollout causal: {model} is an image model (omniloop.json adherence.kind: image)")
        if backend == "diffusers":
            raise click.UsageError(f"--backend diffusers: {model} is an image model; it runs through the runtime")
        rollout = "bidirectional"
    if rollout == "auto":
        rollout = "causal" if meta.get("rollout") == "causal" or model == "wan-demo-causal" else "bidirectional"
    try:
        gen, used, note = _generator(model, meta, rollout=rollout, backend=backend, device=device, dtype=dtype,
                                     batch_size=batch_size, kind=kind, deploy=deploy)
    except DeployError as e:  # e.g. --linear-precision unknown or not runnable here: one line, nothing generated
        raise click.ClickException(str(e)) from None
    if note:
        console.print(f"[yellow]note:[/] {note}")
    prompts = prompts_of(kind, prompt_set)
    reports = []
    from omniloop_kit.progress import clip_progress

    chunk = batch_size if used == "diffusers" else 1  # the diffusers pipeline batches; the runtime runs clip by clip
    for n_steps in step_list:
        n = len(prompts) * len(_ints(seeds))
        with clip_progress(n_steps, n) as advance:
            rep = evaluate(gen, prompts=prompts, seeds=_ints(seeds), steps=n_steps, guidance_scale=g, backend=used,
                           kind=kind, progress=advance, chunk=chunk)
        if note:
            rep.extra["note"] = note
        if deploy:
            rep.extra["deploy"] = dict(deploy)
        reports.append(rep)
        if table:
            t = Table(title=f"{model}: {n_steps} steps, guidance {g}, backend {used}")
            for col in table_columns(kind):
                t.add_column(col)
            for row in format_table(rep):
                t.add_row(*row)
            console.print(t)
    # summary columns: (title, accuracy key)
    summary = ([("color", "color"), ("shape", "shape"), ("position", "position"), ("all three", "all")] if kind == "image"
               else [("color", "color"), ("direction", "direction"), ("color+direction", "all"), ("shape", "shape"),
                     ("no ghost", "clean")])
    lp = "".join(f", {k} {json.dumps(v) if isinstance(v, (dict, list, bool)) else v}" for k, v in sorted(deploy.items()))
    # the deploy's strings are the user's (keep globs such as attn.to_[qkv]): printed as text, not as rich markup
    s = Table(title=f"prompt adherence of {escape(str(model))} ({kind}: {len(prompts)} prompts x seeds {seeds}{escape(lp)})")
    for col in ("steps", "n", *(title for title, _ in summary), "seconds"):
        s.add_column(col, justify="right")
    for rep in reports:
        def cell(k: str, rep: Any = rep) -> str:
            if k not in rep.accuracy:  # e.g. "clean" from a generator that reports no ghosts
                return "-"
            lo, hi = wilson(rep.accuracy[k], rep.n)
            return f"{rep.accuracy[k]:.1%} [{lo:.0%}-{hi:.0%}]"

        s.add_row(str(rep.steps), str(rep.n), *(cell(k) for _, k in summary), f"{rep.seconds:.1f}")
    console.print(s)
    if json_out:
        Path(json_out).write_text(json.dumps({"model": model, "kind": kind, "reports": [r.to_dict() for r in reports]}, indent=1))
        console.print(f"wrote {json_out}")


#: the fields of a deploy file that ``eval adherence`` takes from its own flags instead
_MODEL_FIELDS = ("model", "models", "device", "dtype")


def deploy_settings(deploy_file: str | None) -> dict[str, Any]:
    """The settings of ``deploy_file`` that differ from the defaults, minus the model, device and dtype
    (``--model/--device/--dtype`` give those): the extra ``DeployConfig`` fields of the runtime under
    test. The file is validated as a whole first (``omniloop.deploy.load_deploy``): a bad file is one
    usage error, before any model loads."""
    if deploy_file is None:
        return {}
    from omniloop.deploy import DeployConfig, load_deploy
    from omniloop.errors import DeployError
    from omniloop.schema import converter

    try:
        cfg = load_deploy(deploy_file)
    except DeployError as e:
        raise click.UsageError(f"--deploy {e}") from None
    if cfg.pipeline is not None:
        raise click.UsageError(f"--deploy {deploy_file}: a composed pipeline ({cfg.pipeline!r}); eval adherence "
                               "evaluates one model")
    data = converter.unstructure(cfg)
    defaults = converter.unstructure(DeployConfig())
    return {k: v for k, v in data.items() if k not in _MODEL_FIELDS and v != defaults.get(k)}


def _generator(model: str, meta: dict[str, Any], *, rollout: str, backend: str, device: str, dtype: str,
               batch_size: int, kind: str, deploy: dict[str, Any]) -> tuple[Any, str, str | None]:
    """``(generate, backend used, note)`` for ``eval adherence``: streamed clips for a causal rollout,
    else :func:`~omniloop_wan_demo.evaluate.make_generator` (the runtime when ``deploy`` sets anything)."""
    from .evaluate import StreamingRuntimeGenerator, make_generator

    if rollout == "causal":
        opts = None if model == "wan-demo-causal" or not Path(model).is_dir() else {
            "rollout": "causal", "rollout_options": dict(meta.get("rollout_options") or {})}
        return StreamingRuntimeGenerator(model, device=device, dtype=dtype, options=opts, deploy=deploy), "runtime-stream", None
    return make_generator("runtime" if deploy else backend, model=model, device=device, dtype=dtype,
                          batch_size=batch_size, kind=kind, deploy=deploy)


def _audio(model: str, *, steps: str | None, seeds: str, guidance_scale: float | None, prompt_set: str, backend: str,
           rollout: str, device: str, dtype: str, batch_size: int, json_out: str | None, table: bool) -> None:
    """An audio checkpoint (``omniloop.json`` ``"adherence": {"kind": "audio"}``, e.g. tone-demo):
    scored by omniloop-tone-demo's evaluator (timbre, pitch, rhythm)."""
    for flag, value, default in (("--prompts", prompt_set, "default"), ("--rollout", rollout, "auto")):
        if value != default:
            raise click.UsageError(f"{flag} {value}: {model} is an audio model (omniloop.json adherence.kind: audio); "
                                   f"{flag} applies to video and image models")
    try:
        from omniloop_tone_demo.cli import run
    except ImportError:
        raise click.UsageError(f"--model {model}: an audio model; its evaluator is in omniloop-tone-demo "
                               "(pip install omniloop-tone-demo)") from None
    run(model, steps=steps, seeds=seeds, guidance_scale=guidance_scale, device=device, dtype=dtype,
        batch_size=batch_size, json_out=json_out, table=table, backend=backend)


def _checkpoint_meta(model: str) -> dict[str, Any]:
    """The ``omniloop.json`` of ``model``: a folder, an installed preset's folder (e.g.
    ``flux-demo``), ``wan-demo-causal``'s, or else wan-demo's."""
    from .checkpoint_path import causal_checkpoint_dir, checkpoint_dir

    if Path(model).is_dir():
        path = Path(model)
    elif model == "wan-demo-causal":
        path = causal_checkpoint_dir()
    elif model == "wan-demo":
        path = checkpoint_dir()
    else:
        found = _preset_dir(model)
        if found is None:
            return {}  # not a folder nor an installed preset: loading it names the problem
        path = found
    f = path / "omniloop.json"
    try:
        got = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return dict(got) if isinstance(got, dict) else {}


def _preset_dir(name: str) -> Path | None:
    """The checkpoint folder of an installed model preset (``None``: no such preset). A preset
    whose weights are not installed (its ``path()`` raises, e.g. flux-demo before shipping) is a
    usage error with the preset's own one-line reason."""
    from omniloop.errors import OmniloopError
    from omniloop.plugins import default_manager

    preset = default_manager().registry().presets.get(name)
    if preset is None:
        return None
    try:
        return Path(preset.path())
    except OmniloopError as e:
        raise click.UsageError(f"--model {name}: {e}") from None


@click.command("compare")
@click.argument("base", type=click.Path(dir_okay=False))
@click.argument("other", type=click.Path(dir_okay=False))
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False), help="write the comparison here")
@click.option("--features", is_flag=True,
              help="also the paired shift of each measurement the detector made (area, fill, centroid, travel, ...)")
@click.option("--by", default="shape", show_default=True, metavar="CHECK",
              help="with --features: also per expected value of this check ('' for all clips only)")
def compare_cmd(base: str, other: str, json_out: str | None, features: bool, by: str) -> None:
    """Verdicts lost and gained from BASE to OTHER, with McNemar's exact p.

    BASE and OTHER are two 'eval adherence --json' reports of the same prompts and seeds, matched
    clip by clip. The p says whether a change (precision, backend, checkpoint) costs adherence or
    only flips verdicts both ways, as any change of rounding does. With --features, the detector's
    measurements behind the verdicts are compared too: the mean shift of each (OTHER - BASE), its
    standard error and p — a systematic change shows there long before the verdict counts move.

    \b
        omniloop eval adherence --json bf16.json
        omniloop eval adherence --linear-precision fp8 --json fp8.json
        omniloop eval compare bf16.json fp8.json --features
    """
    from rich.console import Console
    from rich.table import Table

    from .compare import SIGNIFICANCE, ReportError, compare, feature_shifts, load_report

    try:
        docs = load_report(base), load_report(other)
        result = compare(*docs)
        if features:
            result["features"] = feature_shifts(*docs, by=by or None)
    except ReportError as e:
        raise click.UsageError(str(e)) from None
    except ValueError as e:
        raise click.UsageError(f"{base} vs {other}: {e}") from None
    console = Console()

    def table(title: str, rows: list[dict[str, Any]]) -> Table:
        t = Table(title=title)
        for col in ("check", "base", "other", "lost", "gained", "McNemar p", "reading"):
            t.add_column(col, justify="left" if col in ("check", "reading") else "right")
        for r in rows:
            t.add_row(r["check"], f"{r['base']:.1%}", f"{r['other']:.1%}", str(r["lost"]), str(r["gained"]),
                      f"{r['p']:.3f}", r["reading"])
        return t

    pooled = " (all step counts)" if "by_steps" in result else ""
    console.print(table(f"{escape(other)} against {escape(base)}: {result['clips']} shared clips{pooled} ({result['kind']})",
                        result["checks"]))
    for group in result.get("by_steps", []):
        console.print(table(f"{group['steps']} steps: {group['clips']} clips", group["checks"]))
    skipped = result["only_in_base"] + result["only_in_other"]
    if skipped:
        console.print(f"[yellow]{result['only_in_base']} clip(s) only in {escape(base)}, {result['only_in_other']} only in "
                      f"{escape(other)}: not compared[/yellow]")
    console.print(f"'no effect seen': p >= {SIGNIFICANCE} — the lost/gained split is what the noise of a change of "
                  "rounding makes; more clips (seeds) resolve smaller effects")
    if features:
        rows = result["features"]
        per = f" (all clips, then per expected {by})" if by else ""
        t = Table(title=f"the detector's measurements, {escape(other)} - {escape(base)}, clip by clip{per}")
        for col in ("clips", "measure", "n", "base", "shift", "± se", "z", "p"):
            t.add_column(col, justify="left" if col in ("clips", "measure") else "right", no_wrap=True)
        for r in rows:
            t.add_row(r["group"].split("=", 1)[-1], r["feature"], str(r["n"]), f"{r['base_mean']:.4g}",
                      f"{r['shift']:+.2g}", f"{r['se']:.1g}", f"{r['z']:+.1f}",
                      f"{r['p']:.0e}" + (" *" if r["reading"] == "shifts" else "  "))
        console.print(t if rows else "[yellow]no measurement shared by both reports' clips[/yellow]")
        if rows:
            console.print(f"*: p below {SIGNIFICANCE}/{len(rows)} (Bonferroni over the rows) — the change moves this "
                          "measurement systematically, whatever the verdicts did")
    if json_out:
        Path(json_out).write_text(json.dumps({"base": base, "other": other, **result}, indent=1))
        console.print(f"wrote {json_out}")


@click.command("merge")
@click.argument("out", type=click.Path(dir_okay=False))
@click.argument("reports", nargs=-1, required=True, type=click.Path(dir_okay=False))
def merge_cmd(out: str, reports: tuple[str, ...]) -> None:
    """Merge several 'eval adherence --json' REPORTS of one evaluation into OUT.

    For an evaluation split over runs (seeds 0,1 in one, 2,3 in another: a time limit, two
    machines). The runs must share model, kind, steps, guidance, backend and deploy; no clip
    (prompt, seed) may be in two of them. Accuracy is recomputed over all clips; OUT is then
    one report for 'eval compare'.

    \b
        omniloop eval merge bf16.json bf16-s01.json bf16-s23.json
        omniloop eval merge fp8.json fp8-s01.json fp8-s23.json
        omniloop eval compare bf16.json fp8.json --features
    """
    from .compare import ReportError, load_report, merge_reports

    target = Path(out)
    if any(target.resolve() == Path(r).resolve() for r in reports):
        raise click.UsageError(f"OUT {out} is one of the REPORTS: write the merge to a new file")
    try:
        merged = merge_reports([load_report(r) for r in reports], list(reports))
    except ReportError as e:
        raise click.UsageError(str(e)) from None
    except ValueError as e:
        raise click.UsageError(f"cannot merge: {e}") from None
    tmp = target.with_name(f".{target.name}.part")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(target)  # whole or not at all
    n = sum(r["n"] for r in merged["reports"])
    click.echo(f"wrote {out}: {n} clips from {len(reports)} reports")


def add_to(cli: click.Group) -> None:
    """Add ``eval adherence``, ``eval compare`` and ``eval merge`` to the ``omniloop`` group (reusing an ``eval``
    group if one exists)."""
    group = cli.commands.get("eval") if hasattr(cli, "commands") else None
    if group is None or not isinstance(group, click.Group):
        @click.group("eval")
        def group() -> None:
            """Evaluate models."""

        cli.add_command(group)
    group.add_command(adherence)
    group.add_command(compare_cmd)
    group.add_command(merge_cmd)


@click.group()
def main() -> None:
    """Standalone entry (``python -m omniloop_wan_demo.cli eval adherence``) for when the
    omniloop CLI is not installed."""


add_to(main)

if __name__ == "__main__":
    main()
