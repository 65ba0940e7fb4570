"""``omniloop generate``: one request, validated before any compute, with rich progress.

Order of work: parse flags → validate the request JSON (schema) → check that ``--out`` can be
written → resolve the deployment without weights and run every request check that needs none
(``omniloop.Deployment.check``: task, limits, prompt, plugin params, the family's checks when it
can inspect its checkpoint) → load the model → ``Runtime.prepare`` (node params and the family's
full checks) → run through the deploy's scheduler, showing a progress bar per node and per step →
write the output file: an mp4 for a video (with its sound track as AAC when the output also holds
audio), a png/webp for an image (an ``Image`` artifact, or a video of one frame), an audio file for
audio (``--task t2a``, or the track alone of a video with sound: ``.wav``, ``.flac``, ``.mp3``,
``.ogg``/``.opus``, by suffix; an unknown suffix is refused before anything loads). A text task (``--task reason``) writes no file: its text goes to stdout (the
summary to stderr).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from .app import fail, get_manager

VIDEO_SUFFIXES = (".mp4",)
IMAGE_SUFFIXES = (".png", ".webp")
IMAGE_TASKS = ("t2i", "i2i")
#: tasks whose output is audio alone
AUDIO_TASKS = ("t2a",)
#: tasks whose output is text: printed on stdout, no file
TEXT_TASKS = ("reason",)


class JsonScalar(click.ParamType):
    """A value parsed as a JSON scalar when it is one (``4``, ``2.5``, ``true``, ``null``), else a string.

    Numbers are not converted by click: the request schema checks them, so a bad value is
    reported with its field path (``diffusion.steps: expected an integer, got str 'abc'``).
    """

    name = "value"

    def __init__(self, metavar: str = "VALUE") -> None:
        self.metavar = metavar

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.metavar

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return parse_scalar(value) if isinstance(value, str) else value


def parse_scalar(text: str) -> Any:
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, (int, float, bool, str)) or v is None else text


def parse_plugin_params(items: tuple[str, ...], flag: str = "--plugin-param") -> dict[str, dict[str, Any]]:
    """``("cache-dit.Fn=8", "cache-dit.enabled=false")`` → ``{"cache-dit": {"Fn": 8, "enabled": False}}``.

    ``NAME.KEY.SUB=VALUE`` nests. The value is a JSON scalar when it parses as one, else a string.
    ``--node-param NODE.KEY=VALUE`` is parsed the same way (``flag`` names it in errors).
    """
    out: dict[str, dict[str, Any]] = {}
    hint = f"'{flag}'"
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, rest = key.partition(".")
        if not eq or not dot or not name or not rest:
            raise click.BadParameter(f"expected NAME.KEY=VALUE, got {item!r}", param_hint=hint)
        target = out.setdefault(name, {})
        *parents, leaf = rest.split(".")
        for p in parents:
            nxt = target.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise click.BadParameter(f"{name}.{p} is given both as a value and as a group", param_hint=hint)
            target = nxt
        if isinstance(target.get(leaf), dict):
            raise click.BadParameter(f"{key} is given both as a group and as a value", param_hint=hint)
        target[leaf] = parse_scalar(value)
    return out


#: the node ``--strength`` tunes: every image-edit pipeline's loop node is ``denoise``
STRENGTH_NODE = "denoise"


def node_params_of(items: tuple[str, ...], strength: Any) -> dict[str, dict[str, Any]]:
    """``--node-param NODE.KEY=VALUE`` (repeatable) and ``--strength X`` (= ``denoise.strength``)
    as a request's ``node_params``; validated later by the pipeline's node schemas, like a request's."""
    params = parse_plugin_params(items, "--node-param")
    if strength is not None:
        given = params.get(STRENGTH_NODE, {}).get("strength")
        if given is not None and given != strength:
            fail(f"--strength {strength} and --node-param {STRENGTH_NODE}.strength={given} disagree; give one")
        params.setdefault(STRENGTH_NODE, {})["strength"] = strength
    return params


def model_config(model: str) -> dict[str, str]:
    """A preset name (``wan-demo``) or a checkpoint path, the way ``Runtime.from_model`` tells them apart."""
    looks_like_path = os.sep in model or model.startswith(".") or Path(model).exists()
    return {"path": os.path.expanduser(model)} if looks_like_path else {"preset": model}  # as typed: ./x stays ./x


def build_deploy(deploy_file: str | None, model: str | None, device: str | None, dtype: str | None) -> Any:
    """The deploy config: ``--deploy FILE`` if given, with ``--model/--device/--dtype`` overriding it."""
    from omniloop.deploy import load_deploy
    from omniloop.schema import converter

    if deploy_file is None and model is None:
        fail("give --model NAME|PATH or --deploy FILE")
    data: dict[str, Any] = converter.unstructure(load_deploy(deploy_file)) if deploy_file else {}
    if model is not None:
        data["model"] = model_config(model)
    if device is not None:
        data["device"] = device
    if dtype is not None:
        data["dtype"] = dtype
    return load_deploy(data)


#: flags that plugins add (``omniloop_register_run_options``) -> the distribution that adds them,
#: so that a flag given without its plugin says what to install
KNOWN_RUN_OPTIONS = {"profile": "omniloop-profiler"}


class GenerateCommand(click.Command):
    """``generate`` plus one ``--<name>`` flag per installed plugin's :class:`RunOptionSpec`."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        have = {p.name for p in params}
        extra = [
            click.Option([f"--{name}", f"run_option__{name}"], is_flag=True, help=spec.help or f"Added by plugin {name!r}.")
            for name, spec in sorted(run_options(ctx).items()) if f"run_option__{name}" not in have
        ]
        return params[:-1] + extra + params[-1:]  # before --help

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            name = (exc.option_name or "").lstrip("-")
            if name in KNOWN_RUN_OPTIONS:
                fail(f"--{name} needs the plugin that adds it: pip install {KNOWN_RUN_OPTIONS[name]}")
            raise


def run_options(ctx: click.Context) -> dict[str, Any]:
    """The installed plugins' generate flags (none when discovery fails: the CLI still works).

    Only the run-option hook is called (``PluginManager.registered``): parsing the command line, its
    ``--help`` and a refused flag import no family (nor torch)."""
    try:
        return dict(get_manager(ctx).registered("omniloop_register_run_options").run_options)
    except Exception:
        return {}


def build_request(
    prompt: str, *, task: str, negative_prompt: str | None, image: str | None, diffusion: dict[str, Any],
    plugin_params: dict[str, dict[str, Any]], return_latents: bool, sampling: dict[str, Any] | None = None,
    node_params: dict[str, dict[str, Any]] | None = None, audio: dict[str, Any] | None = None,
) -> dict[str, Any]:
    req: dict[str, Any] = {"task": parse_scalar(task), "prompt": prompt}
    if negative_prompt is not None:
        req["negative_prompt"] = negative_prompt
    if image is not None:
        req["inputs"] = [{"type": "image", "path": str(Path(image).resolve())}]
    d = {k: v for k, v in diffusion.items() if v is not None}
    if d:
        req["diffusion"] = d
    if plugin_params:
        req["plugin_params"] = plugin_params
    if node_params:
        req["node_params"] = node_params
    if return_latents:
        req["outputs"] = {"return_latents": True}
    s = {k: v for k, v in (sampling or {}).items() if v is not None}
    if s:
        req["sampling"] = s
    a = {k: v for k, v in (audio or {}).items() if v is not None}
    if a:
        req["audio"] = a
    return req


#: tasks that read an input image (``--image``)
IMAGE_INPUT_TASKS = ("i2v", "i2i", "v2v")


def check_flags_apply(request: Any, *, image: str | None, stream: bool) -> None:
    """Refuse, before anything loads, a flag the request's task would ignore (one line, exit 2)."""
    task = request.task.value
    if image is not None and task not in IMAGE_INPUT_TASKS:
        fail(f"--image: a {task} request takes no input image; use --task i2v (image to video) or "
             "--task i2i (image edit), or drop --image")
    if stream and task in TEXT_TASKS:
        fail(f"--stream: writes video frames as they come; a {task} request prints its text when it is done")


def check_stream_supported(runtime: Any, request: Any, name: str) -> None:
    """``--stream`` on a pipeline that emits no frames while it runs (``Node.emits``) would write
    nothing until the end: refuse it before any compute."""
    from omniloop.artifacts import Image, VideoFrames

    spec = runtime.pipeline(request.task).spec
    if not any(issubclass(t, (VideoFrames, Image)) for t in spec.partial_outputs.values()):
        fail_no_stream(request, name)


def fail_no_stream(request: Any, name: str) -> None:
    fail(f"--stream: the {request.task.value} pipeline of model {name} emits no frames while it runs (a streaming "
         "deployment does, e.g. --model wan-demo-causal or a deploy with options.rollout: causal); drop --stream")


def output_path(out: str | None, request: Any) -> Path:
    """Where the result goes: ``--out`` (a file, or a folder), default ``./out/<request_id>.mp4|png|wav``.

    An audio suffix on a video task is accepted here (a video with sound writes its track alone);
    whether the model makes audio for it is checked against the deployment (:func:`check_audio_out`)."""
    from omniloop_io.media import AUDIO_FORMATS

    audio_only = request.task.value in AUDIO_TASKS
    single = request.task.value in IMAGE_TASKS or request.diffusion.frames == 1
    default_name = f"{request.request_id}{'.wav' if audio_only else '.png' if single else '.mp4'}"
    if out is None:
        return Path("out") / default_name
    p = Path(out).expanduser()
    if out.endswith(("/", os.sep)) or p.is_dir():
        return p / default_name
    suffix = p.suffix.lower()
    audio_types = ", ".join(AUDIO_FORMATS)
    if audio_only:
        if suffix not in AUDIO_FORMATS:
            fail(f"--out: a {request.task.value} request makes audio; unsupported file type {p.suffix or '(none)'!r} "
                 f"(use {audio_types})")
        return p
    if suffix not in VIDEO_SUFFIXES + IMAGE_SUFFIXES + tuple(AUDIO_FORMATS):
        fail(f"--out: unsupported file type {p.suffix or '(none)'!r}; use .mp4 for video, .png or .webp for an image, "
             f"{audio_types} for audio")
    if p.suffix.lower() in IMAGE_SUFFIXES and not single:
        fail(f"--out: a {p.suffix.lower()} holds one frame; a {request.task.value} request makes a video (use .mp4, or --frames 1)")
    return p


def check_audio_out(deployment: Any, request: Any, path: Path) -> None:
    """Refuse, before any compute, audio flags (``--seconds``/``--start``) and an audio ``--out``
    for a request whose model makes no audio (``FamilyCapabilities.makes_audio``)."""
    from omniloop_io.media import AUDIO_FORMATS

    if deployment.capabilities.makes_audio(request.task) or request.task not in deployment.supported_tasks:
        return  # (a task the model does not do: the request check names the task)
    task = request.task.value
    if request.audio is not None:
        fail(f"--seconds/--start: model {deployment.model_name} makes no audio for a {task} request (family "
             f"{deployment.family.name!r}); drop them")
    if path.suffix.lower() in AUDIO_FORMATS:
        fail(f"--out: a {path.suffix.lower()} holds audio; model {deployment.model_name} makes no audio for a "
             f"{task} request (use .mp4 for video, .png or .webp for an image)")


def check_writable(path: Path) -> None:
    """Fail now (before any model is loaded) if ``path`` cannot be written (see
    :func:`omniloop_io.media.check_writable`); a folder given without a trailing '/' is an error."""
    from omniloop_io.media import MediaError
    from omniloop_io.media import check_writable as check

    try:
        check(path)
    except MediaError as exc:
        fail(f"--out: {exc}")


#: request fields that get a flag of their own: ``--<field-name>`` from the schema's attrs classes
#: (``DiffusionParams``, ``SamplingParams``), so a field added to the schema gets a flag; older
#: short names stay as aliases
FLAG_GROUPS = ("diffusion", "sampling", "audio")
FLAG_ALIASES = {"diffusion.guidance_scale": ("--guidance",)}
#: the audio fields whose flags keep their plain names (the clip's window)
UNQUALIFIED_AUDIO = ("seconds", "start")
FLAG_HELP = {
    "diffusion.steps": "Denoising steps (family default if omitted).",
    "diffusion.guidance_scale": "Guidance scale.",
    "diffusion.shift": "Flow-matching timestep shift (family default if omitted).",
    "diffusion.height": "Output height in pixels.",
    "diffusion.width": "Output width in pixels.",
    "diffusion.frames": "Number of frames.",
    "diffusion.fps": "Frame rate of the output video.",
    "diffusion.seed": "Random seed (random if omitted; reported in the output).",
    "sampling.temperature": "Text tasks (reason): sampling temperature (0: greedy).",
    "sampling.top_p": "Text tasks (reason): nucleus sampling mass.",
    "sampling.top_k": "Text tasks (reason): sample among the k most likely tokens (0: all).",
    "sampling.max_tokens": "Text tasks (reason): new tokens at most.",
    "sampling.seed": "Text tasks (reason): the sampling seed (default: --seed).",
    "sampling.stop": "Text tasks (reason): a stop string.",
    "audio.seconds": "Audio (t2a, or a video model with sound): the clip's length in seconds (default: the model's maximum).",
    "audio.start": "Audio: where the clip's window starts, in seconds (default 0).",
}


def group_class(group: str) -> Any:
    """The attrs class of a request field group (``audio`` is optional: its class)."""
    import typing

    from omniloop.request import OmniRequest

    t = typing.get_type_hints(OmniRequest)[group]
    return next((a for a in typing.get_args(t) if a is not type(None)), t)


def request_flags() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(group, field, parameter name, flag names) for every flag derived from the request schema."""
    import attrs

    out = []
    taken: set[str] = set()
    for group in FLAG_GROUPS:
        for f in attrs.fields(group_class(group)):
            path = f"{group}.{f.name}"
            flag = f"--{f.name.replace('_', '-')}"
            # a name two groups share (or another field's alias: --guidance) is qualified in the later
            # group (--sampling-seed), and so is every audio knob but the window (--audio-guidance, --audio-stg)
            if flag in taken or (group == "audio" and f.name not in UNQUALIFIED_AUDIO):
                flag = f"--{group}-{f.name.replace('_', '-')}"
            aliases = FLAG_ALIASES.get(path, ())
            taken.update((flag, *aliases))
            out.append((group, f.name, f"{group}__{f.name}", (flag, *aliases)))
    return out


def _field_kind(group: str, name: str) -> str:
    import typing

    t = typing.get_type_hints(group_class(group)).get(name)
    if t is list or typing.get_origin(t) is list:
        return "LIST"
    args = set(typing.get_args(t)) | {t}
    return "INT" if int in args else "FLOAT" if float in args else "VALUE"


def request_options(fn: Any) -> Any:
    """Add one option per derived request flag (see :func:`request_flags`); a list field's flag repeats."""
    for group, name, dest, flags in reversed(request_flags()):
        kind = _field_kind(group, name)
        help_text = FLAG_HELP.get(f"{group}.{name}", f"The request's {group}.{name}.")
        if kind == "LIST":
            fn = click.option(*flags, dest, multiple=True, help=help_text + " (repeatable)")(fn)
        else:
            fn = click.option(*flags, dest, type=JsonScalar(kind), default=None, help=help_text)(fn)
    return fn


@click.command("generate", cls=GenerateCommand)
@click.argument("prompt")
@click.option("--model", "-m", help="A model preset name (e.g. wan-demo) or a checkpoint path.")
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False), help="A deploy file (.yaml/.toml/.json); --model/--device/--dtype override it.")
@click.option("--task", default=None, help="The task, declared (t2v, i2v, t2i, t2a, ...). Default: t2v, or t2i / t2a for an image-only / audio-only model.")
@request_options
@click.option("--negative-prompt", help="What to steer away from.")
@click.option("--image", type=click.Path(exists=True, dir_okay=False), help="An input image (i2v, i2i).")
@click.option("--plugin-param", "plugin_param", multiple=True, metavar="NAME.KEY=VALUE", help="Tune an enabled plugin for this request (repeatable).")
@click.option("--node-param", "node_param", multiple=True, metavar="NODE.KEY=VALUE", help="Set a node parameter of the pipeline (the request's node_params; repeatable; `omniloop schema --model M` lists them).")
@click.option("--strength", type=JsonScalar("FLOAT"), default=None, help="Image edits (i2i): how far from the input image to go, 0..1 (the denoise node's strength; family default if omitted).")
@click.option("--adapter", "adapter", multiple=True, metavar="NAME[=SCALE]", help="Apply a LoRA adapter the deployment declares (repeatable, stacked in order; scale 1 by default).")
@click.option("--device", help="cpu, cuda, cuda:1, ... (overrides the deploy file).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Overrides the deploy file.")
@click.option("--out", "-o", "out", help="Output file (.mp4; .png or .webp for an image; .wav, .flac, .mp3, .ogg or .opus for audio) or folder. Default: ./out/<request_id>.mp4 (.png for an image, .wav for audio)")
@click.option("--return-latents", is_flag=True, help="Also save the final latents (<out>.latents.pt).")
@click.option("--json", "as_json", is_flag=True, help="Print the output's metadata as JSON on stdout.")
@click.option("--stream", is_flag=True, help="Write frames as they come (a streaming deployment's chunks) as PNGs in <out stem>.frames/.")
@click.pass_context
def generate(
    ctx: click.Context, prompt: str, model: str | None, deploy_file: str | None, task: str | None,
    negative_prompt: str | None, image: str | None, plugin_param: tuple[str, ...], adapter: tuple[str, ...], device: str | None,
    dtype: str | None, out: str | None, return_latents: bool, as_json: bool, stream: bool = False,
    node_param: tuple[str, ...] = (), strength: Any = None, **fields: Any,
) -> None:
    """Generate a video (or image) from PROMPT and write it to a file.

    Bad input (a request field, the deploy, an unwritable --out) is refused before the model
    loads; Ctrl-C stops the run and exits 130."""
    from omniloop.schema import request_from_dict

    from .default_task import FALLBACK, check_declared_limits, default_task
    from .progress import console
    from .stream import FrameStream

    # 1. the request, validated by the schema before anything heavy is imported (no torch, no
    # family: a bad value is refused in a fraction of a second; tests/cli/test_fast_start.py)
    groups: dict[str, dict[str, Any]] = {g: {} for g in FLAG_GROUPS}
    for group, name, dest, _ in request_flags():
        value = fields.get(dest)
        groups[group][name] = (list(value) or None) if isinstance(value, tuple) else value
    req_dict = build_request(
        prompt, task=task or FALLBACK, negative_prompt=negative_prompt, image=image, diffusion=groups["diffusion"],
        plugin_params=parse_plugin_params(plugin_param), return_latents=return_latents, sampling=groups["sampling"],
        node_params=node_params_of(node_param, strength), audio=groups["audio"],
    )
    if adapter:
        from .adapters import parse_adapters

        req_dict["adapters"] = parse_adapters(adapter)
    if stream:  # PARTIAL events carry each chunk's frames (omniloop_cli.stream)
        req_dict.setdefault("outputs", {})["stream_partial"] = True
    request = request_from_dict(req_dict)  # the schema's rules do not depend on the task
    if task is None:  # the model's own prompt-only task (omniloop_cli.default_task): needs the family
        req_dict["task"] = default_task(deploy_file, model, device, dtype, get_manager(ctx))
        request = request_from_dict(req_dict)
    text_task = request.task.value in TEXT_TASKS
    check_flags_apply(request, image=image, stream=stream)
    if text_task:
        if out is not None:
            fail(f"--out: a {request.task.value} request prints its text on stdout and writes no file")
        path = Path("out") / f"{request.request_id}.txt"  # names plugin reports (--profile) only
    else:
        path = output_path(out, request)
        check_writable(path)
    deploy = build_deploy(deploy_file, model, device, dtype)
    chosen = [spec for name, spec in run_options(ctx).items() if fields.get(f"run_option__{name}")]
    for spec in chosen:  # plugin flags (--profile): the plugin turns itself on for this run
        deploy = spec.enable(deploy, path)

    err = console(stderr=True)
    frame_stream = FrameStream(path) if stream and not text_task else None
    if deploy.pipeline is not None or deploy.models:  # pipeline + models by role (e.g. prompt-upsample): several runtimes
        if model is not None:
            fail("--model: a composed deploy (pipeline: ...) names its models under models.<role>; drop --model")
        if chosen:
            fail("run-option flags (e.g. --profile) are not supported with a composed deploy yet")
        from omniloop_io.media import AUDIO_FORMATS

        if not text_task and path.suffix.lower() in AUDIO_FORMATS and request.task.value not in AUDIO_TASKS:
            fail(f"--out: a {path.suffix.lower()} holds audio; a composed deploy's {request.task.value} pipeline "
                 "writes video (use .mp4)")
        runtime, output, load_seconds = _run_composed(ctx, deploy, request, err, frame_stream, as_json)
    else:
        # 2. the request against the deployment, without weights; then the model, and full validation
        check_declared_limits(deploy, request, get_manager(ctx))  # the checkpoint's omniloop.json range, before torch
        from omniloop.runtime import Deployment

        deployment = Deployment(deploy, manager=get_manager(ctx))
        if stream and not text_task and not deployment.rollout.streams:  # the family's declaration, before load
            fail_no_stream(request, deployment.model_name)
        if not text_task:
            check_audio_out(deployment, request, path)
        deployment.check(request)
        from .vocabulary import warn_vocabulary  # a checkpoint's omniloop.json "vocabulary": one warning line

        warn_vocabulary(err, deployment.model_path, prompt, deploy.model.preset or deployment.model_path.name)
        if chosen and deploy.parallel.world_size > 1:
            fail("run-option flags (e.g. --profile) are not supported with a parallel deploy yet")
        t0 = time.perf_counter()
        with err.status("loading model ..."):
            runtime = load_runtime(deploy, get_manager(ctx))
        load_seconds = time.perf_counter() - t0
        try:
            output = _run_one(runtime, request, err, frame_stream)
        finally:
            close = getattr(runtime, "close", None)  # worker processes (parallel / placement) stop here
            if callable(close):
                close()

    # 4. write what came back
    from .output import compute_settings, summarize, write_outputs

    files = write_outputs(output, path, latents=return_latents) if output.ok and not text_task else {}
    if frame_stream is not None and frame_stream.frames:
        files["frames"] = frame_stream.folder
    text = output.artifacts["text"].text if text_task and output.ok and "text" in output.artifacts else None
    for spec in chosen:
        if spec.report is not None:
            files.update(spec.report(runtime, output, path, as_json))
    if as_json:
        from omniloop.schema import output_to_dict

        doc = output_to_dict(output)
        doc["output_path"] = str(files["output"]) if "output" in files else None
        doc["files"] = {k: str(v) for k, v in files.items()}
        doc["load_seconds"] = round(load_seconds, 6)
        doc["compute"] = compute_settings(runtime)
        if not text_task:  # a composed deploy's text edges (prompt-upsample: expanded_prompt)
            doc.update({k: v for k, v in _texts(output).items() if k not in doc})
        if text is not None:
            doc["text"] = text
        click.echo(json.dumps(doc, indent=2))
    else:
        if text is not None:
            click.echo(text)
        summarize(console(stderr=text_task), output, files, load_seconds, compute_settings(runtime))
        if not text_task:
            for name, value in _texts(output).items():
                err.print(f"  {name}: {value}", highlight=False, markup=False)
    if not output.ok:
        e = output.error
        where = f" in node {e.node!r}" + (f" at step {e.step}" if e.step is not None else "") if e and e.node else ""
        fail(f"request {output.status.value}{where}: {e.message if e else 'no error recorded'}", exit_code=1)


def load_runtime(deploy: Any, manager: Any) -> Any:
    """The deploy's runtime through :meth:`omniloop.runtime.Runtime.from_deploy`, the one factory:
    a plain ``Runtime``, or — for ``parallel`` above one process or ``placement`` — omniloop-parallel's
    ``ParallelRuntime`` / ``RolePoolRuntime`` (worker processes)."""
    from omniloop.runtime import Runtime

    return Runtime.from_deploy(deploy, manager=manager)


def _follow(events: Any, status: Any, frame_stream: Any, announce: Any = None) -> Any:
    """Drain a runtime's event stream: each loop step on the ``status`` line (``node: step i/n``;
    only progress events carry ``total``), each event to ``frame_stream`` when one is open; an
    event ``announce(event)`` handles (returns True) skips the status line. The output of the last
    event that carries one."""
    output = None
    for event in events:
        if announce is not None and announce(event):
            pass
        elif event.step is not None and event.total:
            status.update(f"{event.node}: step {event.step}/{event.total}")
        if frame_stream is not None:
            frame_stream.update(event)
        if event.output is not None:
            output = event.output
    assert output is not None
    return output


def _run_one(runtime: Any, request: Any, err: Any, frame_stream: Any) -> Any:
    """Run ``request``: node by node with progress bars on a runtime that prepares executions here,
    else (the SPMD pool: rank 0 runs it) through ``runtime.stream`` with a status line."""
    from .progress import RunProgress

    if not callable(getattr(runtime, "prepare", None)):
        with err.status("running on the worker pool ...") as status:
            return _follow(runtime.stream(request), status, frame_stream)
    if frame_stream is not None:
        check_stream_supported(runtime, request, runtime.model_name)
    execution = runtime.prepare(request)
    from rich.markup import escape

    for w in execution.state.metrics.get("warnings") or []:  # before any compute, not after the run
        err.print(f"[yellow]warning:[/] {escape(str(w))}", highlight=False, soft_wrap=True)
    # 3. run, with progress per node and per step
    output = None
    with RunProgress(err, execution) as progress:
        for event in runtime.scheduler.stream(execution):
            progress.update(event)
            if frame_stream is not None:
                frame_stream.update(event)
            if event.output is not None:
                output = event.output
    return output if output is not None else execution.output


def _texts(output: Any) -> dict[str, str]:
    """The ``Text`` artifacts of a video/image output (a composed deploy's expanded prompt)."""
    from omniloop.artifacts import Text

    return {name: art.text for name, art in output.artifacts.items() if isinstance(art, Text)}


def _run_composed(ctx: click.Context, deploy: Any, request: Any, err: Any, frame_stream: Any,
                  as_json: bool) -> tuple[Any, Any, float]:
    """A composed deploy (omniloop-compose, through its runtime loader): checked without weights, then every role loaded
    and the request run node by node (each role through its own scheduler). A text edge a node
    writes (prompt-upsample's ``expanded_prompt``) is printed on stderr as soon as it exists."""
    from omniloop.artifacts import Text
    from omniloop.request import EventKind
    from omniloop.runtime import Runtime, check_request

    check_request(deploy, request, manager=get_manager(ctx))
    t0 = time.perf_counter()
    with err.status("loading models ..."):
        runtime = Runtime.from_deploy(deploy, manager=get_manager(ctx))
    load_seconds = time.perf_counter() - t0

    def announce(event: Any) -> bool:
        if event.kind is EventKind.PROGRESS and isinstance(event.value, Text) and not as_json:
            err.print(f"{event.node} wrote {event.artifact}: {event.value.text}", highlight=False, markup=False)
            return True
        return False

    with err.status("running ...") as status:
        output = _follow(runtime.stream(request), status, frame_stream, announce)
    return runtime, output, load_seconds
