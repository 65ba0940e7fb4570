"""A Cosmos 3 request resolved once, before any compute: defaults, sizes, the prompt templates and
the token ids of both CFG branches.

The prompt text is what ``Cosmos3OmniPipeline.tokenize_prompt`` makes of a request: the duration
and resolution sentences appended to the prompt (their negations to the negative prompt, ``""``
when none is given), the mode's system prompt, the checkpoint's chat template with a generation
prompt, then ``eos`` and ``<|vision_start|>`` appended. Both branches are tokenized here, once;
the denoise node computes each branch's text (understanding) segment once from these ids.
"""

from __future__ import annotations

from typing import Any

from attrs import define

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType
from omniloop.resolved import Workload, bounds
from omniloop_kit.resolve import check_task, conditioning_image, require_prompt

#: diffusers' defaults (``Cosmos3OmniPipeline.__call__``): 35 steps, guidance 6, 189 frames of 720x1280 at 24 fps
DEFAULTS: dict[str, Any] = {"steps": 35, "guidance_scale": 6.0, "num_frames": 189, "height": 720, "width": 1280,
                            "fps": 24.0}
TASKS = frozenset({TaskType.T2V, TaskType.I2V, TaskType.V2V})
#: v2v: the latent frames of the video kept clean (diffusers' ``condition_frame_indexes_vision`` default)
V2V_CONDITION_FRAMES = (0, 1)
#: the image part roles an i2v request's first frame may have
IMAGE_ROLES = ("image", "first_frame")

SYSTEM_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."
DURATION = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
NOT_DURATION = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
RESOLUTION = {True: "This image is of {height}x{width} resolution.", False: "This video is of {height}x{width} resolution."}
NOT_RESOLUTION = {True: "This image is not of {height}x{width} resolution.",
                  False: "This video is not of {height}x{width} resolution."}


@define(frozen=True)
class Cosmos3Resolved:
    """A Cosmos 3 request resolved (the family's ``omniloop.resolved.Resolved``)."""

    task: TaskType
    prompt: str
    negative_prompt: str
    steps: int
    guidance_scale: float
    num_frames: int
    height: int
    width: int
    fps: float
    #: token ids of the cond and uncond branches (templates, chat template, eos, vision start)
    cond_ids: tuple[int, ...]
    uncond_ids: tuple[int, ...]
    #: a sound track denoised with the video (``audio.enabled``)
    sound: bool = False
    #: i2v: the first frame, uint8 ``[H, W, 3]`` (None for t2v, or before decoding)
    image: Any = None
    #: an action request resolved (:class:`omniloop_cosmos3.action.ActionSpec`), else None
    action: Any = None
    #: v2v: the conditioning video, uint8 ``[T, H, W, 3]`` (its first frames condition the clip)
    video: Any = None
    warnings: tuple[str, ...] = ()

    @property
    def cfg(self) -> bool:
        """diffusers runs the uncond branch whenever ``guidance_scale != 1.0`` (below 1 too)."""
        return self.guidance_scale != 1.0

    def workload(self) -> Workload:
        return Workload(steps=self.steps, branches=2 if self.cfg else 1, frames=self.num_frames, height=self.height,
                        width=self.width, bounded=bounds(steps=self.steps, frames=self.num_frames, height=self.height,
                                                         width=self.width))


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def prompt_text(text: str, *, negative: bool, num_frames: int, height: int, width: int, fps: float) -> str:
    """The prompt with its metadata sentences (their negations for the negative prompt)."""
    image = num_frames == 1
    if not image:
        text = _append(text, (NOT_DURATION if negative else DURATION).format(duration=num_frames / fps, fps=fps))
    return _append(text, (NOT_RESOLUTION if negative else RESOLUTION)[image].format(height=height, width=width))


def token_ids(tokenizer: Any, text: str, *, image: bool, system: bool = True) -> tuple[int, ...]:
    """The chat-templated ids of ``text`` plus ``eos`` and ``<|vision_start|>``."""
    turns = ([{"role": "system", "content": SYSTEM_IMAGE if image else SYSTEM_VIDEO}] if system else [])
    turns.append({"role": "user", "content": text})
    enc = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, add_vision_id=False,
                                        return_dict=True)
    return (*enc.input_ids, tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>"))


def _value(got: Any, default: Any) -> Any:
    return default if got is None else got


def resolve(model: LoadedModel, request: OmniRequest, *, decode_image: bool = True) -> Cosmos3Resolved:
    """Defaults applied, sizes checked, both branches tokenized; ``RequestError`` naming the field."""
    c = model.config
    check_task(request.task, c["tasks"], "the cosmos3 family")
    prompt = require_prompt(request)
    d, dft = request.diffusion, c["defaults"]
    frames, height, width = (int(_value(d.frames, dft["num_frames"])), int(_value(d.height, dft["height"])),
                             int(_value(d.width, dft["width"])))
    fps = float(_value(d.fps, dft["fps"]))
    sf = c["vae_scale_spatial"]
    for name, v in (("height", height), ("width", width)):
        if v % sf:
            raise RequestError(f"diffusion.{name}", f"{v} is not a multiple of {sf} (the VAE's spatial factor)")
    sound = wants_sound(request)
    if request.audio is not None and (request.audio.seconds is not None or request.audio.start):
        field = "audio.seconds" if request.audio.seconds is not None else "audio.start"
        raise RequestError(field, "the sound track spans the video (diffusion.frames / diffusion.fps); leave "
                           "audio.seconds and audio.start unset")
    if sound and c["sound"] is None:
        raise RequestError("audio.enabled", "this checkpoint makes no sound (it has no sound tokenizer, or its "
                           "transformer no sound head)")
    warnings: list[str] = []
    video = None
    if request.task is TaskType.V2V and request.action is None:  # video-to-video: its first latent frames kept
        if frames == 1:
            raise RequestError("diffusion.frames", "video-to-video needs more than one frame")
        if (frames - 1) // c["vae_scale_temporal"] + 1 <= max(V2V_CONDITION_FRAMES):
            raise RequestError("diffusion.frames", f"{frames} frames are too few: the first latent frames "
                               f"{list(V2V_CONDITION_FRAMES)} of the video condition the clip")
        video = conditioning_video(request) if decode_image else None
    image = conditioning_image(request, request.task is TaskType.I2V, IMAGE_ROLES, warnings,
                               decode=decode_image or request.action is not None,
                               missing="an i2v request needs an image part (role image or first_frame)",
                               extra="{n} more image part(s) ignored (only the first image/first_frame is used)")
    negative = request.negative_prompt or ""
    tok = model.components["text_tokenizer"]
    action = None
    if request.action is not None:  # the action caption; the negative prompt as given (no templates)
        from .action import caption, resolve_action

        if request.task is TaskType.V2V:
            image = conditioning_video(request)
        action = resolve_action(request, c, image, warnings)
        frames, (height, width) = action.chunk_size + 1, action.canvas
        cond_text, uncond_text = caption(prompt, action, fps), negative
    else:
        kw = dict(num_frames=frames, height=height, width=width, fps=fps)
        cond_text, uncond_text = prompt_text(prompt, negative=False, **kw), prompt_text(negative, negative=True, **kw)
    cond = token_ids(tok, cond_text, image=frames == 1)
    uncond = token_ids(tok, uncond_text, image=frames == 1)
    return Cosmos3Resolved(task=request.task, prompt=prompt, negative_prompt=negative,
                           steps=int(_value(d.steps, dft["steps"])),
                           guidance_scale=float(_value(d.guidance_scale, dft["guidance_scale"])),
                           num_frames=frames, height=height, width=width, fps=fps, cond_ids=cond, uncond_ids=uncond,
                           sound=sound, image=image, action=action, video=video, warnings=tuple(warnings))


def conditioning_video(request: OmniRequest) -> Any:
    """The first video part (role ``video``), decoded to uint8 ``[T, H, W, 3]`` (the first 1024 frames)."""
    from omniloop.request import VideoPart
    from omniloop_io.media import read_video

    for i, part in enumerate(request.inputs):
        if isinstance(part, VideoPart) and part.role == "video":
            return read_video(part.path, name=f"inputs[{i}].path")
    raise RequestError("inputs", "a v2v request needs a video part (role video)")


def wants_sound(request: OmniRequest) -> bool:
    """``audio`` given and not ``enabled: false``: a sound track (``audio: {"enabled": true}``)."""
    return request.audio is not None and request.audio.enabled is not False


__all__ = ["DEFAULTS", "TASKS", "Cosmos3Resolved", "prompt_text", "resolve", "token_ids", "wants_sound"]
