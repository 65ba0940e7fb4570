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
            "seconds_range": (float(projection["min_value"]), float(projection["max_value"]))}


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
    warnings: list[str] = []
    tok = model.components.get("tokenizer")
    if tok is not None:
        budget = int(tok.model_max_length)
        for what, text in (("prompt", prompt), ("negative prompt", negative)):
            n = len(tok(text, truncation=False, verbose=False)["input_ids"]) if text else 0
            if n > budget:
                warnings.append(f"the {what} is {n} T5 tokens long; truncated to the tokenizer's {budget}")
    if negative is not None and guidance <= 1.0:
        warnings.append("the negative prompt is not used: guidance_scale <= 1 turns classifier-free guidance off")
    return AudioResolved(task=task, prompt=prompt, negative_prompt=negative, steps=steps, guidance_scale=guidance,
                         start=start, end=end, sample_start=s0, sample_end=s1,
                         latent_length=cfg["latent_length"], latent_channels=cfg["latent_channels"],
                         warnings=tuple(warnings))


__all__ = ["DEFAULTS", "AudioResolved", "audio_config", "resolve"]
