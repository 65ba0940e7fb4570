"""An LTX-2 request (``t2v``, or ``i2v`` with its first frame as an image part) checked and resolved
once (``LTX2Family.resolve``), before any compute.

Defaults are diffusers' ``LTX2Pipeline.__call__`` defaults: 30 steps, 512x768, 121 frames at
24 fps, guidance 3.0, ``stg`` 1.0 on block 28, ``modality`` 3.0, ``rescale`` 0.7; audio guidance
7.0, audio ``stg`` 1.0, audio ``modality`` 3.0, audio ``rescale`` 0.7; the empty negative prompt;
a 1024-token text (the tokenizer's padding is left whatever its config says, as diffusers sets
it). A checkpoint's ``omniloop.json`` may override them (``{"defaults": {"steps": 2}}``).

Where the knobs come from: ``diffusion.guidance_scale`` (video CFG), ``node_params.denoise``
(:class:`DenoiseParams`: the video's ``stg``, ``modality``, ``rescale`` and ``stg_blocks``) and
``audio`` (:class:`omniloop.request.AudioParams`: ``guidance``, ``stg``, ``modality``,
``rescale``). diffusers reads an audio knob of 0 as "the video's value" (``audio_x or x``);
omniloop refuses an audio 0 while the video's value is not 0 rather than guess (with both 0 it is
0, as in diffusers). The audio track's length is not
a request field: it is the video's (``frames / fps`` seconds, ``round`` half-to-even to audio
latents as diffusers does), so ``audio.seconds`` / ``audio.start`` are refused.

Refused, each one :class:`~omniloop.errors.RequestError` naming the field: frames that do not fit
the video VAE's temporal factor (``frames = k * factor + 1``), height / width not multiples of 32
(diffusers' check; the VAE's spatial factor divides it), a blank prompt, image inputs on t2v,
an i2v request without its first-frame image or with more than one, audio inputs, ``diffusion.shift`` (the schedule's shift is the checkpoint's dynamic one),
``stg_blocks`` naming a block the transformer does not have.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import ImagePart, OmniRequest, TaskType, TextPart
from omniloop_kit.resolve import check_task, conditioning_image, image_size, require_prompt

TASKS = frozenset({TaskType.T2V, TaskType.I2V})
#: the image part roles an i2v request conditions on (the first frame)
IMAGE_ROLES = ("image", "first_frame")
DEFAULTS: dict[str, Any] = {
    "steps": 30, "height": 512, "width": 768, "frames": 121, "fps": 24.0, "guidance_scale": 3.0,
    "stg": 1.0, "modality": 3.0, "rescale": 0.7, "stg_blocks": [28],
    "audio_guidance": 7.0, "audio_stg": 1.0, "audio_modality": 3.0, "audio_rescale": 0.7,
    "negative_prompt": "", "max_sequence_length": 1024, "use_cross_timestep": True,
}
#: the audio knobs of ``request.audio`` this family reads
AUDIO_KNOBS = ("guidance", "stg", "modality", "rescale")


def _finite(v: float | None) -> str | None:
    import math

    return None if v is None or math.isfinite(v) else "must be a finite number"


@define(frozen=True)
class DenoiseParams:
    """``node_params.denoise``: the video side's guidance passes (None: the checkpoint's default).

    ``stg``: the spatio-temporal guidance scale (a pass with the self-attention of ``stg_blocks``
    replaced by its values; 0 turns it off); ``modality``: the modality-isolation scale (a pass
    without the audio-video cross-attention; 1 turns it off); ``rescale``: diffusers'
    ``guidance_rescale`` of the guided x0 toward the conditional's spread (0 turns it off)."""

    stg: float | None = field(default=None, metadata={"ge": 0.0, "le": 100.0, "check": _finite})
    modality: float | None = field(default=None, metadata={"ge": 0.0, "le": 100.0, "check": _finite})
    rescale: float | None = field(default=None, metadata={"ge": 0.0, "le": 1.0, "check": _finite})
    stg_blocks: list[int] | None = None
    #: i2v: the H.264 CRF the conditioning image is re-compressed at before the VAE encodes it (as
    #: the model was trained; None: diffusers' default for the text encoder, 33 for Gemma 3; 0: none)
    image_crf: int | None = field(default=None, metadata={"ge": 0, "le": 51})


@define(frozen=True)
class LTX2Resolved:
    """A request's resolved parameters: the family's ``omniloop.resolved.Resolved``."""

    task: TaskType
    prompt: str
    negative_prompt: str
    steps: int
    height: int
    width: int
    frames: int
    fps: float
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_frames: int
    guidance: float
    stg: float
    modality: float
    rescale: float
    audio_guidance: float
    audio_stg: float
    audio_modality: float
    audio_rescale: float
    stg_blocks: tuple[int, ...]
    max_sequence_length: int
    use_cross_timestep: bool
    warnings: tuple[str, ...] = ()
    #: i2v: the first frame (uint8 ``[H, W, 3]``; None when not decoded: a check without compute)
    image: Any = field(default=None, eq=False, repr=False)
    image_crf: int = 0

    @property
    def cfg(self) -> bool:
        return self.guidance > 1.0 or self.audio_guidance > 1.0

    @property
    def stg_on(self) -> bool:
        return self.stg > 0.0 or self.audio_stg > 0.0

    @property
    def modality_on(self) -> bool:
        return self.modality > 1.0 or self.audio_modality > 1.0

    @property
    def passes(self) -> tuple[str, ...]:
        """The transformer calls of one step: ``cfg`` (uncond and cond rows), else ``cond``; then
        ``stg`` and ``modality`` when on."""
        return ("cfg" if self.cfg else "cond",) + (("stg",) if self.stg_on else ()) + \
            (("modality",) if self.modality_on else ())

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    def workload(self) -> Any:
        from omniloop.resolved import Workload, bounds

        return Workload(steps=self.steps, branches=len(self.passes) + (1 if self.cfg else 0), frames=self.frames,
                        height=self.height, width=self.width,
                        bounded=bounds(steps=self.steps, frames=self.frames, height=self.height, width=self.width))


def ltx2_config(components: dict[str, Any]) -> dict[str, Any]:
    """The model facts requests are resolved against, from the loaded components (diffusers'
    ``LTX2Pipeline.__init__`` reads the same attributes)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    vae, audio, tf = components["vae"], components["audio_vae"], components["transformer"]
    rate, hop = float(audio.config.sample_rate), float(audio.config.mel_hop_length)
    return {"spatial_ratio": int(vae.spatial_compression_ratio), "temporal_ratio": int(vae.temporal_compression_ratio),
            "audio_latents_per_second": rate / hop / float(audio.temporal_compression_ratio),
            "layers": int(tf.config.num_layers), "perturbed_attn": bool(tf.config.perturbed_attn),
            "sample_rate": int(components["vocoder"].config.output_sampling_rate),
            "image_crf": int(resolve_default_image_crf(components["text_encoder"]))}


def _audio_knob(request: OmniRequest, name: str, default: float, video: float) -> float:
    """``audio.<name>`` (None: ``default``); 0 is refused unless the video's value is 0 too (then
    diffusers' ``audio_x or x`` gives 0 as well: no ambiguity)."""
    audio = request.audio
    value = getattr(audio, name, None) if audio is not None else None
    if value is None:
        return float(default)
    if value == 0.0 and video != 0.0:
        raise RequestError(f"audio.{name}", f"0 with a video value of {video:g} is ambiguous: diffusers reads an audio "
                                            "knob of 0 as 'use the video's value' (audio_x or x); give the value you "
                                            "mean, or set the video's to 0 too")
    return float(value)


def resolve(model: LoadedModel, request: OmniRequest, node_params: Any = None, *,
            decode_image: bool = True) -> LTX2Resolved:
    """Check ``request`` against ``model`` (config only: works on an inspected model too)."""
    cfg = model.config
    d = model.config["defaults"]
    check_task(request.task, TASKS, "the ltx2 family")
    prompt = require_prompt(request)
    i2v = request.task is TaskType.I2V
    others = [i for i, p in enumerate(request.inputs)
              if not isinstance(p, TextPart) and not (i2v and isinstance(p, ImagePart) and p.role in IMAGE_ROLES)]
    if others:
        raise RequestError(f"inputs[{others[0]}]", f"an ltx2 {request.task.value} request is conditioned on text"
                           + (" and one first-frame image (role 'image' or 'first_frame')" if i2v else
                              " only (image conditioning is task i2v)"))
    r = request.diffusion
    if r.shift is not None:
        raise RequestError("diffusion.shift", "the ltx2 schedule's shift is the checkpoint's (dynamic, from the "
                                              "video's token count); remove it")
    audio = request.audio
    if audio is not None and (audio.seconds is not None or audio.start != 0.0):
        raise RequestError("audio.seconds" if audio.seconds is not None else "audio.start",
                           "the sound track lasts what the video lasts (diffusion.frames / diffusion.fps); remove it")
    warnings: list[str] = []
    height = image_size(request, "height", d["height"], 32, warnings)
    width = image_size(request, "width", d["width"], 32, warnings)
    frames = int(r.frames if r.frames is not None else d["frames"])
    t = cfg["temporal_ratio"]
    if (frames - 1) % t:
        lo = (frames - 1) // t * t + 1
        raise RequestError("diffusion.frames", f"must be a multiple of the VAE's temporal factor {t} plus 1, got "
                                               f"{frames} (try {lo} or {lo + t})")
    fps = float(r.fps if r.fps is not None else d["fps"])
    dp = node_params if isinstance(node_params, DenoiseParams) else DenoiseParams()
    blocks = tuple(dp.stg_blocks if dp.stg_blocks is not None else d["stg_blocks"])
    bad = [b for b in blocks if not 0 <= b < cfg["layers"]]
    if bad:
        raise RequestError("node_params.denoise.stg_blocks", f"block {bad[0]} does not exist (the transformer has "
                                                             f"{cfg['layers']} blocks, 0..{cfg['layers'] - 1})")
    guidance = float(r.guidance_scale if r.guidance_scale is not None else d["guidance_scale"])
    stg = float(dp.stg if dp.stg is not None else d["stg"])
    modality = float(dp.modality if dp.modality is not None else d["modality"])
    rescale = float(dp.rescale if dp.rescale is not None else d["rescale"])
    a_stg = _audio_knob(request, "stg", d["audio_stg"], stg)
    if (stg > 0 or a_stg > 0) and not cfg["perturbed_attn"]:
        warnings.append("the transformer has no perturbed attention (config perturbed_attn: false): the "
                        "spatio-temporal guidance pass perturbs nothing (as in diffusers); set node_params.denoise.stg "
                        "to 0 to skip it")
    elif (stg > 0 or a_stg > 0) and not blocks:
        raise RequestError("node_params.denoise.stg_blocks", "spatio-temporal guidance is on but names no block")
    negative = request.negative_prompt if request.negative_prompt is not None else d["negative_prompt"]
    image = None
    if i2v:
        if sum(isinstance(p, ImagePart) for p in request.inputs) > 1:
            raise RequestError("inputs", "an ltx2 i2v request conditions on one image (the first frame), got more")
        image = conditioning_image(request, True, IMAGE_ROLES, warnings, decode=decode_image,
                                   missing="an i2v request needs an image part (role 'image' or 'first_frame')",
                                   extra="")
    seconds = frames / fps
    return LTX2Resolved(
        task=request.task, prompt=prompt, negative_prompt=negative or "", steps=int(r.steps or d["steps"]),
        height=height, width=width, frames=frames, fps=fps, latent_frames=(frames - 1) // t + 1,
        latent_height=height // cfg["spatial_ratio"], latent_width=width // cfg["spatial_ratio"],
        audio_frames=round(seconds * cfg["audio_latents_per_second"]),
        guidance=guidance, stg=stg, modality=modality, rescale=rescale,
        audio_guidance=_audio_knob(request, "guidance", d["audio_guidance"], guidance), audio_stg=a_stg,
        audio_modality=_audio_knob(request, "modality", d["audio_modality"], modality),
        audio_rescale=_audio_knob(request, "rescale", d["audio_rescale"], rescale), stg_blocks=blocks,
        max_sequence_length=int(d["max_sequence_length"]), use_cross_timestep=bool(d["use_cross_timestep"]),
        warnings=tuple(warnings), image=image,
        image_crf=int(dp.image_crf if dp.image_crf is not None else cfg["image_crf"]) if i2v else 0)


__all__ = ["AUDIO_KNOBS", "DEFAULTS", "TASKS", "DenoiseParams", "LTX2Resolved", "ltx2_config", "resolve"]
