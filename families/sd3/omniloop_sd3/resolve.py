"""Request validation and default resolution for SD3 (``validate_request`` and the validate node).

Every check raises :class:`omniloop.errors.RequestError` naming the field before any compute;
soft problems (a prompt longer than the encoders read, an image given to t2i) come back as
warnings.

Per-request knobs beyond ``diffusion.*``: ``node_params.denoise`` takes the policies' knobs
(``sampler``, ``cfg``, ``guidance_scale``, ``shift``, ``steps``, ...) plus ``strength`` (i2i:
how much of the schedule to run, ``0 < strength <= 1``); ``node_params.text_encode`` takes
``max_sequence_length`` (T5 tokens, ``1..512``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import ImagePart, OmniRequest, TaskType
from omniloop.schema import structure_params
from omniloop_kit.inputs import count_tokens, image_part
from omniloop_policies import DenoiseParams

from .policies import menu_for

MAX_T5_TOKENS = 512
IMAGE_ROLES = ("image", "reference", "first_frame")


@define(frozen=True, kw_only=True)
class SD3DenoiseParams(DenoiseParams):  # type: ignore[misc]
    """``node_params.denoise``: the policies' knobs plus ``strength`` (i2i)."""

    strength: float | None = field(default=None, metadata={"gt": 0.0, "le": 1.0})


@define(frozen=True)
class TextParams:
    """``node_params.text_encode``: the T5 token budget (diffusers' ``max_sequence_length``)."""

    max_sequence_length: int | None = field(default=None, metadata={"ge": 1, "le": MAX_T5_TOKENS})


@define(frozen=True)
class SD3Params:
    """A request's resolved parameters (defaults applied, sizes checked): the family's
    ``omniloop.resolved.Resolved`` — ``Runtime.prepare`` resolves once (``SD3Family.resolve``) and
    the stages read it from ``ctx.resolved``."""

    task: TaskType
    prompt: str
    negative_prompt: str
    height: int
    width: int
    steps: int
    guidance_scale: float
    max_sequence_length: int
    #: i2i only: the fraction of the schedule that runs (diffusers' ``strength``)
    strength: float | None = None
    #: i2i only: uint8 ``[H, W, 3]``
    image: torch.Tensor | None = None
    #: the request's ``omniloop_policies.DenoisePolicies``
    policies: Any = None
    #: soft problems (a prompt longer than the encoders read, an ignored image)
    warnings: tuple[str, ...] = ()
    #: the request field the steps came from (``node_params.denoise.steps`` when a node param set them)
    steps_path: str = "diffusion.steps"

    @property
    def steps_run(self) -> int:
        """Denoise steps that actually run (i2i: ``n - int(n - n * strength)``, diffusers' cut)."""
        if self.strength is None:
            return self.steps
        return self.steps - int(max(self.steps - min(self.steps * self.strength, self.steps), 0))

    def workload(self) -> Any:
        """The scheduler's prior: steps, forwards per step (2 with CFG), the output size;
        ``bounded``: what the runtime checks against the deploy's limits."""
        from omniloop.resolved import Workload, bounds

        return Workload(steps=self.steps_run, branches=2 if self.guidance_scale > 1.0 else 1, frames=1,
                        height=self.height, width=self.width,
                        bounded=bounds(steps=self.steps, height=self.height, width=self.width, steps_path=self.steps_path))


def load_image_part(request: OmniRequest) -> tuple[torch.Tensor, str]:
    """Decode the request's input image (the first image part); pixels and its field path."""
    got = image_part(request, IMAGE_ROLES)
    if got is None:
        raise RequestError("inputs", "an i2i request needs an input image (an image part with role 'image')")
    return got


def _token_count(tokenizer: Any, text: str) -> int:
    return count_tokens(tokenizer, text)


def resolve(
    model: LoadedModel, request: OmniRequest, limits: Any = None, *, decode_image: bool = True,
    node_params: Any = None,
) -> tuple[SD3Params, list[str]]:
    """Check ``request`` against ``model`` and ``limits``; its resolved params and warnings.

    ``node_params``: the node params as the core validated them (``Runtime.prepare``); without
    them the same converter validates ``request.node_params`` here (types and ranges live in the
    attrs metadata of :class:`SD3DenoiseParams` / :class:`TextParams`, nowhere else)."""
    cfg = model.config
    task = request.task
    if task not in cfg["tasks"]:
        have = ", ".join(sorted(t.value for t in cfg["tasks"]))
        raise RequestError("task", f"the sd3 family does not do {task.value!r} (it does: {have})")
    defaults = cfg["task_defaults"][task]
    warnings: list[str] = []
    d = request.diffusion

    prompt = request.prompt
    if not prompt or not prompt.strip():
        raise RequestError("inputs", "a text prompt (a text part with role 'prompt') is required")
    negative = request.negative_prompt
    if negative is None:
        negative = str(defaults.get("negative_prompt") or "")

    given = node_params or {}
    raw_params = request.node_params or {}
    dp = given.get("denoise")
    if dp is None:
        dp = structure_params(SD3DenoiseParams, raw_params.get("denoise"), "node_params.denoise")
    tp = given.get("text_encode")
    if tp is None:
        tp = structure_params(TextParams, raw_params.get("text_encode"), "node_params.text_encode")
    strength_raw = dp.strength
    # strength is this family's to apply (the i2i start), not the sampler's: the menu sees the rest
    raw = attrs.evolve(dp, strength=None)

    menu = menu_for(model, task)
    policies = menu.resolve(request, params=raw)
    steps = policies.num_steps
    if steps is None:
        steps = len(policies.timesteps or policies.sampler.timesteps_list)
    steps_path = "node_params.denoise.steps" if raw.steps is not None else "diffusion.steps"

    multiple = cfg["size_multiple"]
    sizes = {}
    for name in ("height", "width"):
        value = getattr(d, name)
        value = int(defaults[name]) if value is None else value
        if value < multiple or value % multiple:
            lo = max(multiple, value - value % multiple)
            raise RequestError(
                f"diffusion.{name}", f"must be a positive multiple of {multiple}, got {value} (try {lo} or {lo + multiple})"
            )
        top = cfg["max_size"]
        if value > top:
            raise RequestError(
                f"diffusion.{name}", f"{value} is above what the transformer's position embedding covers ({top})"
            )
        sizes[name] = value
    if d.frames not in (None, 1):
        raise RequestError("diffusion.frames", f"an image request makes one frame, got {d.frames}")

    msl = tp.max_sequence_length
    if msl is None:
        msl = int(defaults["max_sequence_length"])

    strength = None
    image = None
    images = [p for p in request.inputs if isinstance(p, ImagePart)]
    if task is TaskType.I2I:
        strength = float(defaults.get("strength", 0.6) if strength_raw is None else strength_raw)  # > 0 runs at least one step: n - int(n - n * strength) >= 1
        if decode_image:
            image, _ = load_image_part(request)
        elif not any(p.role in IMAGE_ROLES for p in images):
            raise RequestError("inputs", "an i2i request needs an input image (an image part with role 'image')")
        if len(images) > 1:
            warnings.append(f"{len(images) - 1} more image input(s) ignored: i2i conditions on one image")
    else:
        if strength_raw is not None:
            raise RequestError("node_params.denoise.strength", "strength applies to i2i requests (an input image)")
        if images:
            warnings.append("the image input is ignored: a t2i request does not use it")

    comps = model.components
    clip_max = int(getattr(comps["tokenizer"], "model_max_length", 77))
    for field_name, text in (("prompt", prompt), ("negative prompt", negative)):
        if not text:
            continue
        n = _token_count(comps["tokenizer"], text)
        if n > clip_max:
            warnings.append(f"the {field_name} is {n} CLIP tokens long; CLIP reads {clip_max} (the rest is dropped there)")
        if comps.get("tokenizer_3") is not None:
            n3 = _token_count(comps["tokenizer_3"], text)
            if n3 > msl:
                warnings.append(f"the {field_name} is {n3} T5 tokens long; truncated to max_sequence_length={msl}")

    params = SD3Params(
        task=task, prompt=prompt, negative_prompt=negative, height=sizes["height"], width=sizes["width"],
        steps=int(steps), guidance_scale=float(policies.guidance_scale), max_sequence_length=int(msl),
        strength=strength, image=image, policies=policies, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


__all__ = ["SD3DenoiseParams", "SD3Params", "TextParams", "load_image_part", "resolve"]
