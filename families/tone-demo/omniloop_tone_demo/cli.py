"""``omniloop eval adherence`` for audio checkpoints (``tone-demo``).

    omniloop eval adherence --model tone-demo
    omniloop eval adherence --model ./my-tone-checkpoint --steps 25,100 --seeds 0,1 --json adherence.json

Generates the fixed evaluation prompts (96 by default: a quarter per timbre, every rhythm, notes
cycling) for each seed through omniloop's runtime (the ``stable-audio`` family, one request per
clip; ``--backend diffusers``: diffusers' ``StableAudioPipeline``, batched), reads timbre, pitch and
rhythm back from the waveforms (:mod:`omniloop_tone_demo.evaluate`) and prints accuracies with
95 % Wilson intervals, wall seconds and CPU seconds (the process's, all threads) per clip.

When omniloop-wan-demo is installed its ``eval adherence`` command is the one registered; it hands
checkpoints whose ``omniloop.json`` says ``"adherence": {"kind": "audio"}`` (and ``--model
tone-demo``) to :func:`run`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from .checkpoint_path import checkpoint_dir, checkpoint_missing, materialize


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in str(value).replace(" ", "").split(",") if v]
    except ValueError:
        raise click.UsageError(f"expected comma-separated integers, got {value!r}") from None


def resolve(model: str) -> Path:
    """A checkpoint folder, or the installed ``tone-demo`` preset's; one usage error otherwise."""
    if model == "tone-demo":
        try:
            folder = checkpoint_dir()
        except OSError as e:
            raise click.UsageError(f"--model tone-demo: {e}") from None
        why = checkpoint_missing(folder)
        if why is not None:
            raise click.UsageError(f"--model tone-demo: {why}")
        return folder
    path = Path(model)
    if not path.is_dir():
        raise click.UsageError(f"--model {model}: not a checkpoint folder (nor the preset tone-demo)")
    why = checkpoint_missing(path)
    if why is not None:
        raise click.UsageError(f"--model {model}: not a tone-demo checkpoint ({why.split(';')[0].split('(', 1)[-1]}")
    try:
        return materialize(path)  # a folder with the compact VAE: the complete one built in the cache
    except OSError as e:
        raise click.UsageError(f"--model {model}: {e}") from None


def load_pipeline(folder: Path, device: str = "cpu", dtype: str = "float32"):
    """diffusers' ``StableAudioPipeline`` over ``folder`` (needs ``torchsde``: without it diffusers
    replaces the scheduler class by a placeholder that fails later)."""
    try:
        import torchsde  # noqa: F401
    except ImportError:
        raise click.UsageError("sampling tone-demo needs torchsde (pip install torchsde): diffusers' "
                               "CosineDPMSolverMultistepScheduler draws its noise from a Brownian tree") from None
    import torch
    from diffusers import StableAudioPipeline

    pipe = StableAudioPipeline.from_pretrained(str(folder), torch_dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _has_runtime_family() -> bool:
    from importlib.util import find_spec

    return find_spec("omniloop_stable_audio") is not None


def _runtime_generator(model: str, device: str, dtype: str):
    """Clips through omniloop's runtime (``Runtime.from_model``: the ``stable-audio`` family)."""
    import numpy as np

    from omniloop.runtime import Runtime

    rt = Runtime.from_model(model, device=device, dtype=dtype)

    def generate(prompts: list[str], seeds: list[int], steps: int, guidance: float) -> list[Any]:
        out = []
        for p, seed in zip(prompts, seeds, strict=True):
            res = rt.generate({"task": "t2a", "prompt": p,
                               "diffusion": {"seed": int(seed), "steps": int(steps), "guidance_scale": float(guidance)}})
            if not res.ok:
                raise click.ClickException(f"the runtime failed on {p!r}: {res.error}")
            out.append(np.asarray(res.artifacts["audio"].samples.float().cpu()))
        return out

    return generate


def _diffusers_generator(pipe: Any, device: str):
    """Clips through diffusers' ``StableAudioPipeline`` (one batched call per chunk, one generator per clip)."""
    import numpy as np
    import torch

    def generate(prompts: list[str], seeds: list[int], steps: int, guidance: float) -> list[Any]:
        gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        with torch.no_grad():
            audio = pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, generator=gens,
                         output_type="pt").audios
        return [np.asarray(a.float().cpu()) for a in audio]

    return generate


def run(model: str, *, steps: str | None = None, seeds: str = "0", guidance_scale: float | None = None,
        n_prompts: int = 96, device: str = "cpu", dtype: str = "float32", batch_size: int = 16,
        json_out: str | None = None, table: bool = False, backend: str = "auto") -> list[Any]:
    """Score ``model``; prints a summary table, returns the reports. ``backend``: ``runtime``
    (omniloop's ``stable-audio`` family, one request per clip), ``diffusers`` (its
    ``StableAudioPipeline``, ``batch_size`` clips per call) or ``auto`` (the runtime when
    omniloop-stable-audio is installed)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from .evaluate import clip_seed, score, summarize, wilson
    from .grammar import eval_specs

    folder = resolve(model)
    try:
        meta = json.loads((folder / "omniloop.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    defaults = dict(meta.get("defaults") or {}) if isinstance(meta, dict) else {}
    step_list = _ints(steps) if steps else [int(defaults.get("steps", 100))]
    seed_list = _ints(seeds)
    if not step_list or not seed_list or min(step_list) < 1:
        raise click.UsageError("--steps and --seeds need at least one value (steps >= 1)")
    g = guidance_scale if guidance_scale is not None else float(defaults.get("guidance_scale", 7.0))
    if not (g == g and abs(g) != float("inf")):
        raise click.UsageError(f"--guidance must be a finite number, got {g}")
    specs = eval_specs(n_prompts)
    if backend == "auto":
        backend = "runtime" if _has_runtime_family() else "diffusers"
    generate = (_runtime_generator(model if model == "tone-demo" else str(folder), device, dtype) if backend == "runtime"
                else _diffusers_generator(load_pipeline(folder, device, dtype), device))
    chunk = batch_size if backend == "diffusers" else 1  # the runtime runs one request (one clip) at a time
    console = Console()
    reports = []
    from omniloop_kit.progress import clip_progress

    for n_steps in step_list:
        jobs = [(s, clip_seed(seed, i)) for seed in seed_list for i, s in enumerate(specs)]
        verdicts, t0, c0 = [], time.perf_counter(), time.process_time()
        with clip_progress(n_steps, len(jobs)) as advance:  # advanced per chunk
            for i in range(0, len(jobs), chunk):
                part = jobs[i:i + chunk]
                audio = generate([s.prompt for s, _ in part], [seed for _, seed in part], n_steps, g)
                verdicts += [score(a, s) for a, (s, _) in zip(audio, part, strict=True)]
                advance(len(part))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = max(1, len(verdicts))
        rep = summarize(verdicts, steps=n_steps, guidance_scale=g, seeds=seed_list, device=device, dtype=dtype,
                        backend=backend, batch_size=chunk, threads=torch.get_num_threads(), seconds=round(seconds, 2),
                        seconds_per_clip=round(seconds / n, 3), cpu_seconds=round(cpu, 2),
                        cpu_seconds_per_clip=round(cpu / n, 3))
        reports.append(rep)
        if table:
            t = Table(title=f"{model}: {n_steps} steps, guidance {g}")
            for col in ("prompt", "timbre", "note", "beats/s", "ok"):
                t.add_column(col)
            for v in verdicts:
                r = v.reading
                t.add_row(v.prompt, r.timbre, r.note if v.pitch_ok is not None else "-", str(r.bps),
                          "yes" if v.all_ok else "no")
            console.print(t)
    s = Table(title=f"prompt adherence of {model} (audio: {len(specs)} prompts x seeds {','.join(map(str, seed_list))}, "
                    f"guidance {g}, {device})")
    for col in ("steps", "n", "timbre", "pitch (tonal)", "rhythm", "all three", "s/clip", "CPU s/clip"):
        s.add_column(col, justify="right")
    for rep in reports:
        def cell(k: str, rep: Any = rep) -> str:
            lo, hi = wilson(rep.accuracy[k], rep.counts[k][1])
            return f"{rep.accuracy[k]:.1%} [{lo:.0%}-{hi:.0%}]"

        s.add_row(str(rep.extra["steps"]), str(rep.n), cell("timbre"), cell("pitch"), cell("rhythm"), cell("all"),
                  f"{rep.extra['seconds_per_clip']:.2f}", f"{rep.extra['cpu_seconds_per_clip']:.2f}")
    console.print(s)
    if json_out:
        Path(json_out).write_text(json.dumps({"model": model, "kind": "audio", "reports": [r.to_dict() for r in reports]},
                                             indent=1))
        console.print(f"wrote {json_out}")
    return reports


@click.command("adherence")
@click.option("--model", default="tone-demo", show_default=True, help="tone-demo or a checkpoint folder")
@click.option("--steps", default=None, help="sampling steps; a comma list sweeps (default: the checkpoint's)")
@click.option("--seeds", default="0", show_default=True, help="comma-separated seeds")
@click.option("--guidance", "guidance_scale", default=None, type=float, help="CFG scale (default: the checkpoint's)")
@click.option("--prompts", "n_prompts", default=96, show_default=True, type=click.IntRange(4, 4096),
              help="how many evaluation prompts (a quarter per timbre)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "runtime", "diffusers"]),
              help="runtime: omniloop's stable-audio family, clip by clip; diffusers: StableAudioPipeline, batched; "
              "auto: the runtime when omniloop-stable-audio is installed")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(1, 4096),
              help="clips per diffusers call (the runtime backend runs one at a time)")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False), help="write the full report here")
@click.option("--table/--no-table", default=False, show_default=True, help="print the per-clip table")
def adherence(model: str, steps: str | None, seeds: str, guidance_scale: float | None, n_prompts: int, device: str,
              dtype: str, backend: str, batch_size: int, json_out: str | None, table: bool) -> None:
    """Generate the tone-demo evaluation prompts, read timbre, pitch and rhythm back from the
    audio, report accuracy with 95 % Wilson intervals and seconds per clip."""
    run(model, steps=steps, seeds=seeds, guidance_scale=guidance_scale, n_prompts=n_prompts, device=device,
        dtype=dtype, batch_size=batch_size, json_out=json_out, table=table, backend=backend)


def add_to(cli: click.Group) -> None:
    """Add ``eval adherence`` to the ``omniloop`` group unless another demo package (wan-demo,
    whose command hands audio checkpoints to :func:`run`) already did."""
    group = cli.commands.get("eval") if hasattr(cli, "commands") else None
    if group is None or not isinstance(group, click.Group):
        @click.group("eval")
        def group() -> None:
            """Evaluate models."""

        cli.add_command(group)
    if "adherence" not in group.commands:
        group.add_command(adherence)


@click.group()
def main() -> None:
    """Standalone entry (``python -m omniloop_tone_demo.cli adherence``)."""


main.add_command(adherence)

if __name__ == "__main__":
    main()
