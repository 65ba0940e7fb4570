"""A Wan request resolved once: ``WanFamily.resolve`` → :class:`WanParams` (``ctx.resolved``).

``Runtime.prepare`` calls it exactly once, after the core validated the request's fields and
``node_params`` (ranges in the attrs metadata of ``DiffusionParams`` / ``DenoiseParams``, one
cattrs converter). What is checked here needs the checkpoint: frame counts of the VAE's temporal
scale, sizes multiple of its spatial scale, the image input of I2V, prompt length. The deploy's
step/size limits are not checked here: the runtime checks ``WanParams.workload().bounded`` once,
after resolve (``omniloop.resolved.check_limits``). Every check raises :class:`omniloop.errors.RequestError`
naming the field (``diffusion.frames``, ``inputs[1].path``, ``task``) before any compute; soft
problems (a truncated prompt, an image given to a text-to-video request) come back in
``WanParams.warnings``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import ImagePart, OmniRequest, TaskType
from omniloop.resolved import Workload, bounds
from omniloop_kit.inputs import count_tokens as kit_count_tokens
from omniloop_kit.inputs import image_part

from .defaults import TEXT_LEN


@attrs.define(frozen=True)
class WanParams:
    """A request's resolved parameters (defaults applied, sizes checked)."""

    task: TaskType
    prompt: str
    negative_prompt: str
    height: int
    width: int
    frames: int
    steps: int
    guidance_scale: float
    shift: float | None
    fps: float
    #: uint8 [H, W, 3] for image-conditioned requests, else None
    image: torch.Tensor | None = None
    #: the request's denoise policies (``omniloop_policies.DenoisePolicies``): sampler, CFG
    #: policy, router, scales — resolved from ``node_params.denoise`` > ``diffusion`` > defaults
    policies: Any = None
    #: soft problems (truncated prompt, ignored image inputs)
    warnings: tuple[str, ...] = ()
    #: the request field the steps came from (``node_params.denoise.steps`` when a node param set them)
    steps_path: str = "diffusion.steps"

    def workload(self) -> Workload:
        """The scheduler's size of this request (guidance branches before the CFG policy's init);
        ``bounded``: what the runtime checks against the deploy's limits."""
        return Workload(steps=self.steps, branches=2 if self.guidance_scale > 1.0 else 1, frames=self.frames,
                        height=self.height, width=self.width,
                        bounded=bounds(steps=self.steps, frames=self.frames, height=self.height, width=self.width,
                                       steps_path=self.steps_path))


#: image roles the I2V pipelines condition on (the first frame)
FIRST_FRAME_ROLES = ("image", "first_frame")


def load_image_part(request: OmniRequest) -> tuple[torch.Tensor | None, str]:
    """Decode the request's first-frame image part; return (pixels or None, its field path)."""
    return image_part(request, FIRST_FRAME_ROLES) or (None, "")


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens the text encoder would see before truncation (special tokens included)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return kit_count_tokens(tokenizer, text, clean=prompt_clean)


def resolve(
    model: LoadedModel, request: OmniRequest, limits: Any = None, *, decode_image: bool = True, menu: Any = None,
    node_params: Any = None,
) -> tuple[WanParams, list[str]]:
    """Check ``request`` against ``model``; return its resolved params and warnings (``limits`` are
    the runtime's to check, on the result).

    ``menu`` is the model's policy menu (default: :func:`omniloop_wan.policies.menu_for`); the
    denoise policies are resolved and checked here too, so a bad ``node_params.denoise`` fails
    before any compute with an error naming the node and the policy. ``node_params`` are the
    request's node params as the core validated them (``Runtime.prepare``); without them the
    menu validates ``request.node_params`` with the same converter.
    """
    cfg = model.config
    warnings: list[str] = []
    tasks = cfg["tasks"]
    if request.task not in tasks:
        have = ", ".join(sorted(t.value for t in tasks))
        raise RequestError("task", f"this {cfg['kind']} checkpoint does not do {request.task.value!r} (it does: {have})")
    defaults = cfg["defaults"]
    d = request.diffusion

    prompt = request.prompt
    if not prompt or not prompt.strip():
        raise RequestError("inputs", "a text prompt (a text part with role 'prompt') is required")
    negative = request.negative_prompt
    if negative is None:
        negative = defaults.get("negative_prompt", "")

    # the denoise policies: node_params.denoise > diffusion > the model's defaults
    if menu is None:
        from .policies import menu_for

        menu = menu_for(model)
    structured = (node_params or {}).get(menu.node)
    policies = menu.resolve(request, structured)
    steps = policies.num_steps
    if steps is None:  # a fixed-schedule sampler (few-step): its schedule's length
        steps = len(policies.timesteps or policies.sampler.timesteps_list)
    node_steps = getattr(structured, "steps", None) if structured is not None else (
        (request.node_params or {}).get(menu.node) or {}).get("steps")
    steps_path = f"node_params.{menu.node}.steps" if node_steps is not None else "diffusion.steps"
    guidance = policies.guidance_scale

    t_scale = cfg["vae_scale_temporal"]
    frames = d.frames if d.frames is not None else int(defaults["frames"])
    if frames < 1 or (frames - 1) % t_scale:
        lo = (max(frames, 1) - 1) // t_scale * t_scale + 1
        raise RequestError(
            "diffusion.frames",
            f"must be of the form {t_scale}k+1 (1, {1 + t_scale}, {1 + 2 * t_scale}, ...), got {frames}; "
            f"try {lo} or {lo + t_scale}",
        )

    multiple = cfg["size_multiple"]
    sizes = {}
    for name in ("height", "width"):
        value = getattr(d, name)
        value = int(defaults[name]) if value is None else value
        if value < multiple or value % multiple:
            raise RequestError(f"diffusion.{name}", f"must be a positive multiple of {multiple}, got {value}")
        sizes[name] = value

    fps = d.fps if d.fps is not None else float(defaults.get("fps", 16.0))

    image = None
    images = [p for p in request.inputs if isinstance(p, ImagePart)]
    first = [p for p in images if p.role in FIRST_FRAME_ROLES]
    if request.task is TaskType.I2V:
        if not first:
            raise RequestError(
                "inputs", "an i2v request needs an image (an image part with role 'image' or 'first_frame')"
            )
        if decode_image:
            image, _ = load_image_part(request)
        others = len(images) - 1
        if others:
            roles = sorted({p.role for p in images} - {"image"})
            warnings.append(
                f"{others} more image input(s) ignored ({', '.join(roles) or 'image'}): Wan conditions on one "
                "first frame (last-frame and reference images are not supported yet)"
            )
    elif images:
        warnings.append(f"the image input is ignored: a {request.task.value} request does not use it")

    tokenizer = model.components.get("tokenizer")
    if tokenizer is not None:
        for field, text in (("prompt", prompt), ("negative prompt", negative)):
            if text:
                n = count_tokens(tokenizer, text)
                if n > TEXT_LEN:
                    warnings.append(
                        f"the {field} is {n} tokens long; the text encoder reads {TEXT_LEN}, so it was truncated "
                        f"to its first {TEXT_LEN} tokens"
                    )

    params = WanParams(
        task=request.task, prompt=prompt, negative_prompt=negative, height=sizes["height"], width=sizes["width"],
        frames=frames, steps=int(steps), guidance_scale=float(guidance), shift=policies.requested_shift,
        fps=float(fps), image=image, policies=policies, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings
