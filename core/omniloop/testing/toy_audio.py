"""A toy text-to-audio family: a deterministic sine generator under the runtime-owned loop.

For the audio front ends' tests (the CLI's audio files, the server's ``/v1/audio/*`` routes) without
a real audio model. Like :mod:`.toy` it is registered only where a test asks for it
(``manager.add("toy-audio", ToyAudioPlugin())``), never through an entry point.

What it does, exactly:

* the prompt picks a pitch: one of 24 semitones from 220 Hz (:func:`prompt_frequency`);
* ``denoise`` is a loop of ``diffusion.steps`` steps over latents ``[1, channels, L]`` (``L`` =
  ``latent_rate`` per second of the window), drawn from the request's generator and moved, one
  ``step()`` per solver step, toward the guided target ``u + g (c - u)``: ``c = 0.5`` (the prompt's
  amplitude), ``u = 0.25`` with a negative prompt, else 0 (``g`` is ``diffusion.guidance_scale``;
  with ``g == 1`` one branch). The last step lands on the target exactly;
* ``decode`` writes ``audio``: channel ``k`` is ``amplitude x sin(2 pi f t + k pi / 2)`` sampled at
  the checkpoint's ``sample_rate`` over ``[start, start + seconds)`` (the window of a longer clip),
  clamped to [-1, 1] — an :class:`omniloop.artifacts.Audio` of ``round(seconds x sample_rate)``
  samples per channel.

``toy-av`` (:class:`ToyAudioVideoFamily`, a checkpoint whose config says ``"family": "toy-av"``) is
the joint audio-video twin, the way a video model with a sound track (LTX-2) declares itself: its
task is ``t2v``, ``capabilities.audio_tasks`` lists it, and its output holds the same ``audio`` plus
``video``: 16x16 grey frames at the config's ``fps`` whose brightness follows the latent amplitude,
``round(seconds x fps)`` of them, so both streams last the window.

The request's ``audio.seconds`` defaults to the checkpoint's ``max_seconds`` minus ``audio.start``;
``start + seconds`` above ``max_seconds`` is refused (``audio.seconds``), as are the video fields
(``diffusion.frames``, ``height``, ``width``, ``fps``, ``shift``) a t2a request has no use for.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, ClassVar

import torch
from attrs import define

from ..artifacts import Audio, Conditioning, Latents, VideoFrames
from ..capabilities import FamilyCapabilities
from ..context import StageContext
from ..errors import CheckpointError, RequestError
from ..family import LoadedModel
from ..graph import Node, PipelineSpec
from ..hookspecs import hookimpl
from ..loop import LoopState, RequestState, StepContext, StepResult
from ..request import OmniRequest, TaskType
from ..resolved import Workload, bounds

CONFIG_NAME = "omniloop_toy_audio.json"
DEFAULT_AUDIO_CONFIG: dict[str, Any] = {
    "family": "toy-audio", "sample_rate": 16000, "channels": 2, "max_seconds": 8.0, "latent_rate": 25, "fps": 8.0,
}
#: the amplitudes the loop converges to: the prompt's, and the negative prompt's (0 without one)
COND_AMPLITUDE, NEGATIVE_AMPLITUDE = 0.5, 0.25
BASE_FREQUENCY = 220.0


def prompt_frequency(prompt: str) -> float:
    """The pitch a prompt asks for: ``220 Hz x 2^(k/12)``, ``k = crc32(prompt) mod 24``."""
    return float(BASE_FREQUENCY * 2.0 ** ((zlib.crc32(prompt.strip().lower().encode()) % 24) / 12.0))


def build_toy_audio_checkpoint(path: str | Path, **overrides: Any) -> Path:
    """Write a toy-audio checkpoint (its config; it has no weights) to ``path`` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps({**DEFAULT_AUDIO_CONFIG, **overrides}, indent=1))
    return path


@define(frozen=True)
class ToyAudioResolved:
    """A toy-audio request resolved once: the window, the pitch, the loop's settings."""

    task: TaskType
    steps: int
    guidance_scale: float
    start: float
    seconds: float
    sample_rate: int
    channels: int
    latent_length: int
    frequency: float
    fps: float = 8.0
    warnings: tuple[str, ...] = ()

    @property
    def branches(self) -> tuple[str, ...]:
        return ("cond", "uncond") if self.guidance_scale != 1.0 else ("cond",)

    @property
    def samples(self) -> int:
        return max(1, round(self.seconds * self.sample_rate))

    @property
    def frames(self) -> int:
        """Video frames over the window (``toy-av``)."""
        return max(1, round(self.seconds * self.fps))

    def workload(self) -> Workload:
        return Workload(steps=self.steps, branches=len(self.branches), frames=self.latent_length,
                        bounded=bounds(steps=self.steps))


#: request fields of a video or image that a t2a request does not read
_NOT_AUDIO = ("frames", "height", "width", "fps", "shift")


def resolve_toy_audio(config: dict[str, Any], request: OmniRequest) -> ToyAudioResolved:
    """Check a toy-audio request against the checkpoint's ``config`` and apply the defaults."""
    d = request.diffusion
    for name in _NOT_AUDIO:
        if getattr(d, name) is not None:
            raise RequestError(f"diffusion.{name}", f"a toy-audio {request.task.value} request makes audio and does not "
                               f"read diffusion.{name}; set audio.seconds for its length")
    if not request.prompt:
        raise RequestError("inputs", "a prompt (text part with role 'prompt') is required")
    most = float(config["max_seconds"])
    window = request.audio
    start = window.start if window is not None else 0.0
    if start >= most:
        raise RequestError("audio.start", f"must be below the checkpoint's maximum of {most:g} s, got {start:g}")
    seconds = window.seconds if window is not None and window.seconds is not None else most - start
    if start + seconds > most + 1e-9:
        what = f"audio.start + audio.seconds = {start + seconds:g} s" if start else f"{seconds:g} s"
        raise RequestError("audio.seconds", f"{what} is longer than the checkpoint's maximum of {most:g} s")
    defaults = ToyAudioFamily.defaults
    g = d.guidance_scale if d.guidance_scale is not None else defaults["guidance_scale"]
    return ToyAudioResolved(
        task=request.task, steps=d.steps or defaults["steps"], guidance_scale=float(g), start=float(start),
        seconds=float(seconds), sample_rate=int(config["sample_rate"]), channels=int(config["channels"]),
        latent_length=max(1, math.ceil(seconds * int(config["latent_rate"]))),
        frequency=prompt_frequency(request.prompt), fps=float(config["fps"]),
    )


def _resolved(ctx: StageContext) -> ToyAudioResolved:
    r = ctx.resolved
    if not isinstance(r, ToyAudioResolved):
        raise TypeError("toy-audio stages run under a runtime (ctx.resolved is its ToyAudioResolved)")
    return r


class EncodePrompt:
    """The 'text encoder': the targets each guidance branch moves toward."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        neg = NEGATIVE_AMPLITUDE if (state.request.negative_prompt or "").strip() else 0.0
        state.write("targets", Conditioning(values={"cond": COND_AMPLITUDE, "uncond": neg}), ctx.node.name)


class Denoise:
    """``x += (u + g (c - u) - x) / (steps left)``: one solver step per ``step()``."""

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        r = _resolved(ctx)
        latents = torch.randn((1, r.channels, r.latent_length), generator=state.generator).to(ctx.device)
        loop = LoopState(total=r.steps, branches=r.branches)
        loop.tensors["latents"] = latents
        loop.extra.update(guidance=r.guidance_scale)
        return loop

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        i = loop.step
        left = loop.total - i
        step = StepContext(state.request.request_id, ctx.node.name, i, loop.total, float(1000 * left / loop.total))
        x = loop.tensors["latents"]
        targets = state.read("targets", Conditioning).values
        preds = {b: (targets[b] - x) / left for b in loop.branches}
        g = loop.extra["guidance"]
        v = preds["cond"] if "uncond" not in preds else preds["uncond"] + g * (preds["cond"] - preds["uncond"])
        if ctx.taps_enabled:
            ctx.tap("guided", v, step)
        loop.tensors["latents"] = x + v
        return StepResult(done=i + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        state.write("latents", Latents(tensor=loop.tensors["latents"], modality="audio"), ctx.node.name)


class Decode:
    """Latent amplitudes ``[1, C, L]`` → a sine per channel over the request's window."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        r = _resolved(ctx)
        amp = state.read("latents", Latents).tensor.float().cpu()
        n = r.samples
        envelope = torch.nn.functional.interpolate(amp, size=n, mode="linear", align_corners=True)[0]  # [C, n]
        t = r.start + torch.arange(n, dtype=torch.float64) / r.sample_rate
        phase = torch.arange(r.channels, dtype=torch.float64)[:, None] * (math.pi / 2)
        wave = torch.sin(2 * math.pi * r.frequency * t[None, :] + phase).float()
        samples = (envelope * wave).clamp(-1.0, 1.0).contiguous()
        state.write("audio", Audio(samples=samples, sample_rate=r.sample_rate), ctx.node.name)


class PaintFrames:
    """``toy-av``'s video: 16x16 grey frames whose brightness follows the latent amplitude."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        r = _resolved(ctx)
        amp = state.read("latents", Latents).tensor.float().cpu().mean(dim=1, keepdim=True)  # [1, 1, L]
        level = torch.nn.functional.interpolate(amp, size=r.frames, mode="linear", align_corners=True)[0, 0]
        grey = (level.clamp(0, 1) * 255).round().to(torch.uint8)
        frames = grey[:, None, None, None].expand(r.frames, 16, 16, 3).contiguous()
        state.write("video", VideoFrames(frames=frames, fps=r.fps), ctx.node.name)


class ToyAudioFamily:
    name = "toy-audio"
    tasks = frozenset({TaskType.T2A})
    capabilities = FamilyCapabilities(audio=True, returns_latents=True, inspect=True, resolve=True, task_defaults=True)
    defaults: ClassVar[dict[str, Any]] = {"steps": 4, "guidance_scale": 1.0}

    def detect(self, path: Path) -> bool:
        f = Path(path) / CONFIG_NAME
        return f.is_file() and json.loads(f.read_text()).get("family") == self.name

    def _config(self, path: Path) -> dict[str, Any]:
        f = Path(path) / CONFIG_NAME
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (not a toy-audio checkpoint)")
        try:
            cfg = {**DEFAULT_AUDIO_CONFIG, **json.loads(f.read_text())}
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{f}: malformed JSON: {exc}") from None
        if cfg["channels"] not in (1, 2) or not cfg["max_seconds"] > 0:
            raise CheckpointError(f"{f}: channels must be 1 or 2 and max_seconds > 0")
        return cfg

    def inspect(self, path: Path, *, options: dict[str, Any]) -> LoadedModel:
        return LoadedModel(family=self.name, path=Path(path), components={}, config=self._config(Path(path)))

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        return LoadedModel(family=self.name, path=Path(path), components={}, config=self._config(Path(path)),
                           device=device, dtype=dtype)

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        return {**self.defaults, "seconds": float(model.config["max_seconds"]),
                "sample_rate": int(model.config["sample_rate"])}

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        return PipelineSpec(
            family=self.name, task=task,
            nodes=(
                Node("text_encode", EncodePrompt(), writes={"targets": Conditioning}),
                Node("denoise", Denoise(), reads={"targets": Conditioning}, writes={"latents": Latents}),
                Node("decode", Decode(), reads={"latents": Latents}, writes={"audio": Audio}),
            ),
            outputs={"audio": "audio", "latents": "latents"},
        )

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *,
                node_params: Any = None) -> ToyAudioResolved:
        return resolve_toy_audio(model.config, request)

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        return list(resolve_toy_audio(model.config, request).warnings)


class ToyAudioVideoFamily(ToyAudioFamily):
    """``toy-av``: a ``t2v`` family whose output also holds audio (declared: ``audio_tasks``)."""

    name = "toy-av"
    tasks = frozenset({TaskType.T2V})
    capabilities = FamilyCapabilities(audio=True, returns_latents=True, inspect=True, resolve=True, task_defaults=True,
                                      audio_tasks={TaskType.T2V})

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        spec = super().build_pipeline(model, task, options)
        paint = Node("paint", PaintFrames(), reads={"latents": Latents}, writes={"video": VideoFrames})
        return PipelineSpec(family=self.name, task=task, nodes=(*spec.nodes, paint),
                            outputs={**spec.outputs, "video": "video"})


class ToyAudioPlugin:
    """The toy-audio and toy-av families as an in-process plugin object:
    ``manager.add("toy-audio", ToyAudioPlugin())``; a checkpoint's config picks one."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        register(ToyAudioFamily())
        register(ToyAudioVideoFamily())
