"""Request validation and default resolution, shared by ``validate_request`` and the validate node.

Every check raises :class:`omniloop.errors.RequestError` naming the field (``diffusion.height``,
``inputs[0].path``, ``node_params.denoise.strength``) before any compute; soft problems (a size
rounded down, a truncated prompt, a negative prompt this model does not use) come back as warnings.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import ImagePart, OmniRequest, TaskType
from omniloop.resolved import Workload, bounds
from omniloop.schema import structure_params
from omniloop_kit.inputs import count_tokens as kit_count_tokens
from omniloop_kit.inputs import image_part

from .defaults import MAX_SEQUENCE_LENGTH


@define(frozen=True)
class TextParams:
    """Per-request knobs of the ``text_encode`` node (``node_params.text_encode``)."""

    #: T5 tokens the prompt is padded/truncated to (diffusers' ``max_sequence_length``, at most 512)
    max_sequence_length: int | None = field(default=None, metadata={"ge": 1, "le": MAX_SEQUENCE_LENGTH})


@attrs.define(frozen=True)
class FluxParams:
    """A request's resolved parameters (defaults applied, sizes rounded as diffusers does)."""

    task: TaskType
    prompt: str
    height: int
    width: int
    steps: int
    guidance_scale: float
    max_sequence_length: int
    #: i2i: the fraction of the schedule run (None for t2i)
    strength: float | None = None
    #: uint8 [H, W, 3] for i2i, else None
    image: torch.Tensor | None = None
    #: CFG ``classic`` (true CFG): the negative prompt (default ""), else None (not encoded)
    negative_prompt: str | None = None
    #: what the guidance embedding gets (guidance-distilled checkpoints): the guidance scale with CFG
    #: ``embedded``, the task's default guidance with ``classic`` (whose scale is the true-CFG scale)
    embedded_guidance: float = 3.5
    #: the request's ``omniloop_policies.DenoisePolicies``
    policies: Any = None
    #: soft problems (rounded sizes, truncated prompt, ignored inputs)
    warnings: tuple[str, ...] = ()
    #: the request field the steps came from (``node_params.denoise.steps`` when a node param set them)
    steps_path: str = "diffusion.steps"

    def workload(self) -> Workload:
        """The scheduler's size of this request: the steps the loop runs (i2i: the strength's
        share), two forwards per step with true CFG (a negative prompt encoded), one image."""
        steps = self.steps
        if self.strength is not None:
            from omniloop_policies import strength_steps

            steps = strength_steps(steps, self.strength)
        return Workload(steps=steps, branches=2 if self.negative_prompt is not None else 1, frames=1,
                        height=self.height, width=self.width,
                        bounded=bounds(steps=self.steps, height=self.height, width=self.width, steps_path=self.steps_path))


#: image roles an i2i request's input image may have (the first such part is used)
IMAGE_ROLES = ("image", "reference", "first_frame")


def load_image_part(request: OmniRequest) -> torch.Tensor:
    """Decode the request's input image (the first part with a role in :data:`IMAGE_ROLES`)."""
    got = image_part(request, IMAGE_ROLES)
    if got is None:
        raise RequestError("inputs", "an i2i request needs an input image (an image part with role 'image')")
    return got[0]


def text_params(request: OmniRequest) -> TextParams:
    """``node_params.text_encode`` through the core's converter (a stage driven outside a runtime)."""
    raw = (request.node_params or {}).get("text_encode")
    if isinstance(raw, TextParams):
        return raw
    params: TextParams = structure_params(TextParams, raw, "node_params.text_encode")
    return params


def count_tokens(tokenizer: Any, text: str) -> int:
    return kit_count_tokens(tokenizer, text)


def resolve(
    model: LoadedModel, request: OmniRequest, limits: Any = None, *, decode_image: bool = True, menu: Any = None,
    node_params: Any = None,
) -> tuple[FluxParams, list[str]]:
    """Check ``request`` against ``model`` and ``limits``; return its resolved params and warnings.

    ``node_params``: the request's node params as the core validated them (``Runtime.prepare``,
    ``FluxFamily.resolve``); without them (a stage driven by hand) the same converter runs here."""
    cfg = model.config
    warnings: list[str] = []
    if request.task not in cfg["tasks"]:
        have = ", ".join(sorted(t.value for t in cfg["tasks"]))
        raise RequestError("task", f"the FLUX.1 family does not do {request.task.value!r} (it does: {have})")
    defaults = cfg["defaults"]
    d = request.diffusion
    i2i = request.task is TaskType.I2I

    prompt = request.prompt
    if not prompt or not prompt.strip():
        raise RequestError("inputs", "a text prompt (a text part with role 'prompt') is required")
    if d.frames not in (None, 1):
        raise RequestError("diffusion.frames", f"an image request makes one frame, got {d.frames}")

    if menu is None:
        from .policies import menu_for

        menu = menu_for(model)
    structured = (node_params or {}).get(menu.node)
    policies = menu.resolve(request, structured)  # validates node_params.denoise (a RequestError naming the key)
    denoise_params = _set_knobs(structured, (request.node_params or {}).get(menu.node))
    if policies.requested_shift is not None and cfg["dynamic_shifting"]:
        raise RequestError(
            "diffusion.shift" if denoise_params.get("shift") is None else f"node_params.{menu.node}.shift",
            "this checkpoint shifts its schedule by resolution (use_dynamic_shifting); a fixed shift does not apply",
        )
    strength = policies.strength
    if i2i:
        if strength is None:
            strength = float(defaults["strength"])
        if policies.guidance_scale == menu.default_guidance_scale and _no_scale(request, denoise_params):
            policies = attrs.evolve(policies, guidance_scale=float(defaults["i2i_guidance_scale"]))
        policies = attrs.evolve(policies, strength=strength)
    elif strength is not None:
        raise RequestError(f"node_params.{menu.node}.strength", "strength applies to i2i requests only")
    steps = int(policies.num_steps)
    steps_path = f"node_params.{menu.node}.steps" if denoise_params.get("steps") is not None else "diffusion.steps"
    if i2i:
        from omniloop_policies import strength_steps

        if strength_steps(steps, strength) < 1:
            raise RequestError(
                f"node_params.{menu.node}.strength",
                f"strength {strength} of {steps} steps leaves no step to run; raise strength or steps",
            )

    true_cfg = policies.cfg.name == "classic"
    default_guidance = float(defaults["i2i_guidance_scale"] if i2i else defaults["guidance_scale"])
    if true_cfg:
        negative: str | None = request.negative_prompt or ""
        embedded = default_guidance
    else:
        negative = None
        embedded = float(policies.guidance_scale)
        if request.negative_prompt:
            warnings.append(
                "the negative prompt is ignored: it is used with node_params.denoise.cfg 'classic' (true CFG)"
            )

    multiple = cfg["size_multiple"]
    sizes = {}
    for name in ("height", "width"):
        value = getattr(d, name)
        value = int(defaults[name]) if value is None else int(value)
        rounded = value // multiple * multiple
        if rounded < multiple:
            raise RequestError(f"diffusion.{name}", f"must be at least {multiple}, got {value}")
        if rounded != value:
            warnings.append(f"diffusion.{name} {value} is not a multiple of {multiple}: rounded down to {rounded} (as diffusers does)")
        sizes[name] = rounded

    tp = (node_params or {}).get("text_encode") or text_params(request)
    max_len = int(tp.max_sequence_length or defaults["max_sequence_length"])

    image = None
    images = [p for p in request.inputs if isinstance(p, ImagePart)]
    if i2i:
        if not any(p.role in IMAGE_ROLES for p in images):
            raise RequestError("inputs", "an i2i request needs an input image (an image part with role 'image')")
        if decode_image:
            image = load_image_part(request)
        if len(images) > 1:
            warnings.append(f"{len(images) - 1} more image input(s) ignored: FLUX.1 i2i takes one image")
    elif images:
        warnings.append(f"the image input is ignored: a {request.task.value} request does not use it")

    for key, limit in (("tokenizer", model.components.get("tokenizer")), ("tokenizer_2", model.components.get("tokenizer_2"))):
        if limit is None:
            continue
        cap = int(getattr(limit, "model_max_length", 77)) if key == "tokenizer" else max_len
        n = count_tokens(limit, prompt)
        if n > cap:
            which = "CLIP" if key == "tokenizer" else "T5"
            warnings.append(f"the prompt is {n} {which} tokens long; the {which} encoder reads {cap}, so it was truncated")

    params = FluxParams(
        task=request.task, prompt=prompt, height=sizes["height"], width=sizes["width"], steps=steps,
        guidance_scale=float(policies.guidance_scale), max_sequence_length=max_len,
        strength=strength if i2i else None, image=image, policies=policies, negative_prompt=negative,
        embedded_guidance=embedded, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


def _set_knobs(structured: Any, raw: Any) -> dict[str, Any]:
    """The denoise knobs the request set (validated object, or the raw mapping), as a dict."""
    if structured is not None:
        return {k: v for k, v in attrs.asdict(structured, recurse=False).items() if v is not None}
    return dict(raw) if isinstance(raw, dict) else {}


def _no_scale(request: OmniRequest, denoise_params: dict[str, Any]) -> bool:
    return request.diffusion.guidance_scale is None and denoise_params.get("guidance_scale") is None
