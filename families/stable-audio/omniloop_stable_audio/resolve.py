"""A Stable Audio request checked and resolved once (``StableAudioFamily.resolve``), before any compute.

Defaults are diffusers' ``StableAudioPipeline.__call__`` defaults: 100 steps, guidance 7.0 (CFG on
when > 1), no negative prompt (then the negative branch is all zeros, text and seconds states
alike), ``audio.start`` 0 and the window's end at the checkpoint's maximum length
(``sample_size * hop_length / sampling_rate``: 47.55 s for Stable Audio Open) when
``audio.seconds`` is absent. An ``omniloop.json`` beside ``model_index.json`` may override the
steps, guidance and negative prompt (``{"defaults": {"steps": 4}}``: the tiny checkpoints).

Refused, each one :class:`~omniloop.errors.RequestError` naming the field: a window longer than
the checkpoint's maximum (``audio.seconds``), one that ends beyond it (``audio.start`` +
``audio.seconds``: diffusers would cut a shorter clip silently) or that holds no sample, seconds
outside the projection model's conditioning range, and the request fields an audio request has
no use for (``diffusion.height`` / ``width`` / ``frames`` / ``fps`` / ``shift``, image or video
inputs).
"""

from __future__ import annotations

from typing import Any

from attrs import define

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType, TextPart

DEFAULTS: dict[str, Any] = {"steps": 100, "guidance_scale": 7.0, "negative_prompt": None}
#: ``StableAudio3Pipeline.__call__``'s: 8 steps with the distilled (stochastic ping-pong) scheduler,
#: 100 without (``steps`` None: chosen from the scheduler), guidance off, a 10 s clip
DEFAULTS_3: dict[str, Any] = {"steps": None, "guidance_scale": 1.0, "negative_prompt": None, "seconds": 10.0}
UNUSED = ("height", "width", "frames", "fps", "shift")


@define(frozen=True)
class AudioResolved:
    """A request's resolved parameters: the family's ``omniloop.resolved.Resolved``."""

    task: TaskType
    prompt: str
    #: None: no negative prompt (diffusers' zero negative embedding)
    negative_prompt: str | None
    steps: int
    guidance_scale: float
    #: the window in seconds (conditioning) and in samples of the decoded clip (diffusers' cut)
    start: float
    end: float
    sample_start: int
    sample_end: int
    #: latent frames x channels of the whole clip the DiT denoises (the batch shape)
    latent_length: int
    latent_channels: int
    warnings: tuple[str, ...] = ()
    #: a Stable Audio 3 request (diffusers' ``StableAudio3Pipeline``: T5Gemma and duration
    #: conditioning with context masks, the decoded clip clamped to [-1, 1])
    sa3: bool = False

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def workload(self) -> Any:
        """Steps, forwards per step (the CFG rows run in one forward of two rows) and the latent size."""
        from omniloop.resolved import Workload, bounds

        return Workload(steps=self.steps, branches=2 if self.cfg else 1, frames=1, height=self.latent_channels,
                        width=self.latent_length, bounded=bounds(steps=self.steps))


def audio_config(transformer: dict[str, Any], vae: dict[str, Any], projection: dict[str, Any]) -> dict[str, Any]:
    """The model facts requests are resolved against, from the component configs."""
    import numpy as np

    hop = int(np.prod(vae.get("downsampling_ratios", [2, 4, 4, 8, 8])))
    rate = int(vae.get("sampling_rate", 44100))
    length = int(transformer.get("sample_size", 1024))
    return {"sample_rate": rate, "hop_length": hop, "latent_length": length,
            "latent_channels": int(transformer.get("in_channels", 64)),
            "audio_channels": int(vae.get("audio_channels", 2)),
            "max_seconds": length * hop / rate,
            "seconds_range": (float(projection["min_value"]), float(projection["max_value"])),
            "pipeline": "StableAudioPipeline"}


def audio_config_3(transformer: dict[str, Any], vae: dict[str, Any], duration: dict[str, Any],
                   scheduler: dict[str, Any]) -> dict[str, Any]:
    """Stable Audio 3's facts: the clip's length is the request's (no fixed latent window); the
    longest is the duration embedder's ``max_val`` (its conditioning range)."""
    import math

    lo, hi = float(duration.get("min_val", 0.0)), float(duration.get("max_val", 384.0))
    return {"sample_rate": int(vae.get("sampling_rate", 44100)),
            "hop_length": int(vae.get("patch_size", 256)) * math.prod(vae.get("encoder_strides", [16])),
            "latent_length": None, "latent_channels": int(transformer.get("io_channels", 256)),
            "audio_channels": int(vae.get("audio_channels", 2)), "max_seconds": hi, "seconds_range": (lo, hi),
            "patch_size": int(transformer.get("patch_size", 1)),
            "stochastic": bool(scheduler.get("stochastic_sampling", False)),
            "pipeline": "StableAudio3Pipeline"}


def resolve(model: LoadedModel, request: OmniRequest) -> AudioResolved:
    """Check ``request`` against ``model`` (config only: works on an inspected model too)."""
    cfg = model.config
    task = request.task
    if task is not TaskType.T2A:
        raise RequestError("task", f"the stable-audio family does text-to-audio (t2a), not {task.value!r}")
    defaults = cfg["defaults"]
    d = request.diffusion
    for name in UNUSED:
        if getattr(d, name) is not None:
            raise RequestError(f"diffusion.{name}", "an audio request has no use for it (the clip's length is "
                                                   "audio.seconds); remove it")
    others = [i for i, p in enumerate(request.inputs) if not isinstance(p, TextPart)]
    if others:
        raise RequestError(f"inputs[{others[0]}]", "a t2a request is conditioned on text only (no image, video "
                                                   "or audio inputs)")
    prompt = request.prompt
    if not prompt or not prompt.strip():
        raise RequestError("inputs", "a text prompt (a text part with role 'prompt') is required")
    negative = request.negative_prompt if request.negative_prompt is not None else defaults.get("negative_prompt")

    if cfg["pipeline"] == "StableAudio3Pipeline":
        return _resolve_3(model, request, prompt, negative)
    rate, top = cfg["sample_rate"], cfg["max_seconds"]
    audio = request.audio
    start = float(audio.start) if audio is not None else 0.0
    seconds = audio.seconds if audio is not None else None
    if seconds is not None and seconds > top:
        raise RequestError("audio.seconds", f"{seconds:g} s is longer than this checkpoint makes ({top:g} s)")
    end = top if seconds is None else start + float(seconds)
    if end > top + 1e-9:
        field_ = "audio.start" if seconds is None else "audio.seconds"
        raise RequestError(field_, f"the window [{start:g}, {end:g}] s ends beyond this checkpoint's {top:g} s "
                                   "(the window is cut out of one clip of that length)")
    if start >= end:
        raise RequestError("audio.start", f"{start:g} s is at or after the window's end ({end:g} s)")
    lo, hi = cfg["seconds_range"]
    for name, value in (("audio.start", start), ("audio.seconds", end)):
        if not lo <= value <= hi:
            raise RequestError(name, f"the projection model conditions on seconds in [{lo:g}, {hi:g}], got {value:g}")
    s0, s1 = int(start * rate), int(end * rate)
    if s1 <= s0:
        raise RequestError("audio.seconds", f"{end - start:g} s holds no sample at {rate} Hz")

    steps = int(d.steps if d.steps is not None else defaults["steps"])
    guidance = float(d.guidance_scale if d.guidance_scale is not None else defaults["guidance_scale"])
    return AudioResolved(task=task, prompt=prompt, negative_prompt=negative, steps=steps, guidance_scale=guidance,
                         start=start, end=end, sample_start=s0, sample_end=s1,
                         latent_length=cfg["latent_length"], latent_channels=cfg["latent_channels"],
                         warnings=_warnings(model, prompt, negative, guidance, "T5"))


def _warnings(model: LoadedModel, prompt: str, negative: str | None, guidance: float, what_tokens: str,
              budget_cap: int | None = None) -> tuple[str, ...]:
    warnings: list[str] = []
    tok = model.components.get("tokenizer")
    if tok is not None:
        budget = int(tok.model_max_length) if budget_cap is None else min(int(tok.model_max_length), budget_cap)
        for what, text in (("prompt", prompt), ("negative prompt", negative)):
            n = len(tok(text, truncation=False, verbose=False)["input_ids"]) if text else 0
            if n > budget:
                warnings.append(f"the {what} is {n} {what_tokens} tokens long; truncated to the tokenizer's {budget}")
    if negative is not None and guidance <= 1.0:
        warnings.append("the negative prompt is not used: guidance_scale <= 1 turns classifier-free guidance off")
    return tuple(warnings)


def _resolve_3(model: LoadedModel, request: OmniRequest, prompt: str, negative: str | None) -> AudioResolved:
    """Stable Audio 3 (diffusers' ``StableAudio3Pipeline``): the clip is ``audio.seconds`` long from
    0 (the DiT denoises ``ceil(seconds * rate / hop)`` latent frames; the decode is cut to
    ``int(seconds * rate)`` samples and clamped); no start second (the model conditions on the
    duration only); steps default 8 with the distilled stochastic scheduler, else 100."""
    import math

    cfg, d, audio = model.config, request.diffusion, request.audio
    defaults = cfg["defaults"]
    rate, hop, (lo, hi) = cfg["sample_rate"], cfg["hop_length"], cfg["seconds_range"]
    if audio is not None and float(audio.start) != 0.0:
        raise RequestError("audio.start", "Stable Audio 3 generates a clip from 0 s (it conditions on the duration "
                                          "only); remove audio.start")
    seconds = float(audio.seconds) if audio is not None and audio.seconds is not None else min(defaults["seconds"], hi)
    if seconds <= 0 or not lo <= seconds <= hi:
        raise RequestError("audio.seconds", f"Stable Audio 3's duration conditioning covers [{lo:g}, {hi:g}] s "
                                            "(and a clip is longer than 0 s), "
                                            f"got {seconds:g}")
    length = math.ceil(seconds * rate / hop)
    if length % cfg["patch_size"]:
        raise RequestError("audio.seconds", f"{seconds:g} s makes {length} latent frames, not a multiple of the "
                                            f"DiT's patch size {cfg['patch_size']}")
    n = int(seconds * rate)
    if n < 1:
        raise RequestError("audio.seconds", f"{seconds:g} s holds no sample at {rate} Hz")
    steps = d.steps if d.steps is not None else defaults["steps"]
    steps = int(steps if steps is not None else (8 if cfg["stochastic"] else 100))
    guidance = float(d.guidance_scale if d.guidance_scale is not None else defaults["guidance_scale"])
    return AudioResolved(task=request.task, prompt=prompt, negative_prompt=negative, steps=steps,
                         guidance_scale=guidance, start=0.0, end=seconds, sample_start=0, sample_end=n,
                         latent_length=length, latent_channels=cfg["latent_channels"],
                         warnings=_warnings(model, prompt, negative, guidance, "T5Gemma", 256), sa3=True)


__all__ = ["DEFAULTS", "DEFAULTS_3", "AudioResolved", "audio_config", "audio_config_3", "resolve"]
