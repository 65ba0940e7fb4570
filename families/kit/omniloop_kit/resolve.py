"""The resolve skeleton of a diffusers-format family: the checks every such family makes of a request
once, before any compute (``Runtime.prepare`` → ``family.resolve``), each raising one
:class:`~omniloop.errors.RequestError` naming the field, soft problems returned as warnings.

* :func:`check_task`, :func:`require_prompt`, :func:`one_frame` — the request's task, prompt, frames;
* :func:`denoise_policies` — the request's denoise policies from the menu (``node_params.denoise``
  > ``diffusion`` > defaults), their step count and the field it came from (``steps_path``: what the
  runtime names when a limit refuses it; nothing here checks a deploy limit);
* :func:`image_size` — a height or width fitted to the checkpoint's multiple (refused, or rounded
  down with a warning as diffusers does) and below its position embedding's reach;
* :func:`conditioning_image` — the image an image-conditioned task needs, decoded; extra or
  unused image parts warned;
* :func:`i2i_image`, :func:`i2i_strength` — an image-to-image request's image (:data:`I2I_ROLES`)
  and strength (the share of the schedule run; a default, refused on t2i or leaving no step);
* :class:`TextParams`, :func:`text_params` — ``node_params.text_encode`` of a T5-conditioned
  family (the T5 token budget);
* :func:`token_warning` — a prompt longer than a text encoder reads (:func:`clip_t5_warnings`: CLIP's
  and T5's);
* :class:`ImageParams` — the resolved form of an image request (its ``workload()``);
* :func:`resolve_image` — all of the above for a text-to-image family with no rules of its own
  (examples/minimal-family).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.request import ImagePart, OmniRequest, TaskType
from omniloop.resolved import Workload, bounds
from omniloop.schema import structure_params

from .inputs import count_tokens, image_part


def check_task(task: TaskType, tasks: Iterable[TaskType], who: str) -> None:
    """A request's (or a pipeline's) task must be one of ``tasks`` (``who``: "the FLUX.1 family",
    "this wan2.1-t2v checkpoint")."""
    tasks = frozenset(tasks)
    if task not in tasks:
        have = ", ".join(sorted(t.value for t in tasks))
        raise RequestError("task", f"{who} does not do {task.value!r} (it does: {have})")


def require_prompt(request: OmniRequest) -> str:
    """The request's prompt, which must not be blank."""
    prompt = request.prompt
    if not prompt or not prompt.strip():
        raise RequestError("inputs", "a text prompt (a text part with role 'prompt') is required")
    return prompt


def one_frame(request: OmniRequest) -> None:
    """An image request makes one frame: ``diffusion.frames`` unset or 1."""
    frames = request.diffusion.frames
    if frames not in (None, 1):
        raise RequestError("diffusion.frames", f"an image request makes one frame, got {frames}")


def denoise_policies(menu: Any, request: OmniRequest, structured: Any) -> tuple[Any, int, str]:
    """``(policies, steps, steps_path)``: the menu's resolution of the request (``structured``: its
    ``node_params.<node>`` as the core validated them; None: the menu validates the raw ones), the
    steps the schedule has (a fixed-schedule sampler: its schedule's length) and the request field
    they came from (``node_params.<node>.steps`` when a node param set them)."""
    policies = menu.resolve(request, structured)
    steps = policies.num_steps
    if steps is None:
        steps = len(policies.timesteps or policies.sampler.timesteps_list)
    raw = (request.node_params or {}).get(menu.node)
    given = structured.steps if structured is not None else (raw.get("steps") if isinstance(raw, dict) else None)
    steps_path = f"node_params.{menu.node}.steps" if given is not None else "diffusion.steps"
    return policies, int(steps), steps_path


def image_size(request: OmniRequest, name: str, default: Any, multiple: int, warnings: list[str], *,
               round_down: bool = False, top: int | None = None) -> int:
    """``diffusion.<name>`` (``height`` / ``width``; unset: ``default``) fitted to ``multiple``:
    refused when it is not a positive multiple (with the two nearest as a hint), or — ``round_down``
    — rounded down with a warning as diffusers does; refused above ``top`` (what the transformer's
    position embedding covers)."""
    value = getattr(request.diffusion, name)
    value = int(default) if value is None else int(value)
    if round_down:
        rounded = value // multiple * multiple
        if rounded < multiple:
            raise RequestError(f"diffusion.{name}", f"must be at least {multiple}, got {value}")
        if rounded != value:
            warnings.append(f"diffusion.{name} {value} is not a multiple of {multiple}: rounded down to {rounded} "
                            "(as diffusers does)")
        value = rounded
    elif value < multiple or value % multiple:
        lo = max(multiple, value - value % multiple)
        raise RequestError(f"diffusion.{name}",
                           f"must be a positive multiple of {multiple}, got {value} (try {lo} or {lo + multiple})")
    if top is not None and value > top:
        raise RequestError(f"diffusion.{name}", f"{value} is above what the transformer's position embedding covers ({top})")
    return value


def conditioning_image(request: OmniRequest, needed: bool, roles: Sequence[str], warnings: list[str], *,
                       decode: bool = True, missing: str, extra: str) -> Any:
    """The image an image-conditioned request needs (``needed``): the first part with one of
    ``roles`` (refused with ``missing`` when there is none), decoded when ``decode`` (uint8 ``[H, W,
    3]``; else None); further image parts warned with ``extra`` (formatted with ``n`` and
    ``roles``). A request that needs none has its image parts warned as unused."""
    images = [p for p in request.inputs if isinstance(p, ImagePart)]
    if not needed:
        if images:
            warnings.append(f"the image input is ignored: a {request.task.value} request does not use it")
        return None
    if not any(p.role in roles for p in images):
        raise RequestError("inputs", missing)
    image = None
    if decode:
        got = image_part(request, roles)
        image = got[0] if got is not None else None
    if len(images) > 1:
        others = ", ".join(sorted({p.role for p in images} - {"image"})) or "image"
        warnings.append(extra.format(n=len(images) - 1, roles=others))
    return image


#: the image parts an image-to-image request conditions on (the first such part is used)
I2I_ROLES = ("image", "reference", "first_frame")
NEEDS_I2I_IMAGE = "an i2i request needs an input image (an image part with role 'image')"
#: the most T5 tokens a prompt may be padded or truncated to (diffusers' ``max_sequence_length``)
MAX_T5_TOKENS = 512


def i2i_image(request: OmniRequest, i2i: bool, warnings: list[str], *, decode: bool = True, who: str) -> Any:
    """:func:`conditioning_image` of an image family (``who``: "FLUX.1") that conditions an ``i2i``
    request on one image of :data:`I2I_ROLES`."""
    return conditioning_image(request, i2i, I2I_ROLES, warnings, decode=decode, missing=NEEDS_I2I_IMAGE,
                              extra="{n} more image input(s) ignored: " + f"{who} i2i conditions on one image")


def i2i_strength(policies: Any, i2i: bool, steps: int, default: float, node: str = "denoise") -> Any:
    """``policies`` with an image-to-image request's strength (``node_params.<node>.strength``;
    unset: ``default``), refused when it leaves no step of ``steps`` to run; a strength on a request
    that is not i2i is refused."""
    path = f"node_params.{node}.strength"
    if not i2i:
        if policies.strength is not None:
            raise RequestError(path, "strength applies to i2i requests only")
        return policies
    strength = float(default) if policies.strength is None else float(policies.strength)
    from omniloop_policies import strength_steps

    if strength_steps(steps, strength) < 1:
        raise RequestError(path, f"strength {strength} of {steps} steps leaves no step to run; raise strength or steps")
    return attrs.evolve(policies, strength=strength)


@define(frozen=True)
class TextParams:
    """``node_params.text_encode`` of a T5-conditioned family: the T5 token budget."""

    #: T5 tokens the prompt is padded/truncated to (diffusers' ``max_sequence_length``; unset: the
    #: checkpoint's default)
    max_sequence_length: int | None = field(default=None, metadata={"ge": 1, "le": MAX_T5_TOKENS})


def text_params(request: OmniRequest, node_params: Any = None) -> TextParams:
    """``node_params.text_encode`` as the core validated it (``node_params``), else validated here
    by the core's converter (a stage driven outside a runtime)."""
    given = (node_params or {}).get("text_encode")
    if given is not None:
        return given  # type: ignore[no-any-return]
    raw = (request.node_params or {}).get("text_encode")
    if isinstance(raw, TextParams):
        return raw
    params: TextParams = structure_params(TextParams, raw, "node_params.text_encode")
    return params


def clip_t5_warnings(components: Any, texts: Iterable[tuple[str, str]], t5_tokenizer: str, t5_tokens: int,
                     warnings: list[str]) -> None:
    """:func:`token_warning` of each ``(field, text)`` for CLIP (``components["tokenizer"]``, its
    ``model_max_length``) and for T5 (``components[t5_tokenizer]``, ``t5_tokens``; absent: none)."""
    clip = components.get("tokenizer")
    for field_name, text in texts:
        token_warning(clip, text, int(getattr(clip, "model_max_length", 77)), field_name, "CLIP", warnings)
        token_warning(components.get(t5_tokenizer), text, t5_tokens, field_name, "T5", warnings)


def token_warning(tokenizer: Any, text: str, cap: int, field: str, encoder: str, warnings: list[str], *,
                  clean: Callable[[str], str] | None = None) -> None:
    """Warn when ``text`` (the ``field``: "prompt", "negative prompt") is longer than the ``encoder``
    ("CLIP", "T5") reads (``cap`` tokens): the rest was truncated."""
    if tokenizer is None or not text:
        return
    n = count_tokens(tokenizer, text, clean=clean)
    if n > cap:
        warnings.append(f"the {field} is {n} {encoder} tokens long; the {encoder} encoder reads {cap}, "
                        f"so it was truncated to its first {cap} tokens")


@define(frozen=True, kw_only=True)
class ImageParams:
    """An image request resolved (defaults applied, sizes fitted): the family's
    ``omniloop.resolved.Resolved`` — ``Runtime.prepare`` resolves once and the stages read it."""

    task: TaskType
    prompt: str
    height: int
    width: int
    steps: int
    guidance_scale: float
    #: T5 tokens the prompt is padded/truncated to (diffusers' ``max_sequence_length``)
    max_sequence_length: int
    #: the negative prompt encoded (None: none is encoded)
    negative_prompt: str | None = None
    #: i2i: the fraction of the schedule run (diffusers' ``strength``); None for t2i
    strength: float | None = None
    #: i2i: the input image, uint8 ``[H, W, 3]``
    image: Any = None
    #: the request's ``omniloop_policies.DenoisePolicies``
    policies: Any = None
    #: soft problems (rounded sizes, a truncated prompt, ignored inputs)
    warnings: tuple[str, ...] = ()
    #: the request field the steps came from (``node_params.denoise.steps`` when a node param set them)
    steps_path: str = "diffusion.steps"

    @property
    def steps_run(self) -> int:
        """Denoise steps that actually run (i2i: the strength's share, diffusers' ``get_timesteps``)."""
        if self.strength is None:
            return self.steps
        from omniloop_policies import strength_steps

        return int(strength_steps(self.steps, self.strength))

    def branches(self) -> int:
        """Model forwards per step (2 with classifier-free guidance)."""
        return 2 if self.guidance_scale > 1.0 else 1

    def workload(self) -> Workload:
        """The scheduler's size of this request; ``bounded``: what the runtime checks against the
        deploy's limits (once, after resolve)."""
        return Workload(steps=self.steps_run, branches=self.branches(), frames=1, height=self.height, width=self.width,
                        bounded=bounds(steps=self.steps, height=self.height, width=self.width, steps_path=self.steps_path))


def resolve_image(model: Any, request: OmniRequest, menu: Any, node_params: Any = None, *, who: str,
                  params_type: type[ImageParams] = ImageParams, **extra: Any) -> tuple[ImageParams, list[str]]:
    """The whole resolve of a text-to-image family with no rules of its own: the task among
    ``model.config["tasks"]`` (``who`` names the family), a prompt, one frame, the denoise
    policies, height and width fitted to ``model.config["size_multiple"]`` (unset: the model's
    ``config["defaults"]``), the negative prompt (unset: the defaults', else none) and ``extra``
    fields of ``params_type`` (``max_sequence_length``: the defaults' unless given)."""
    cfg = model.config
    warnings: list[str] = []
    check_task(request.task, cfg["tasks"], who)
    prompt = require_prompt(request)
    one_frame(request)
    policies, steps, steps_path = denoise_policies(menu, request, (node_params or {}).get(menu.node))
    d = cfg["defaults"]
    sizes = {n: image_size(request, n, d[n], cfg["size_multiple"], warnings) for n in ("height", "width")}
    negative = request.negative_prompt if request.negative_prompt is not None else d.get("negative_prompt")
    conditioning_image(request, False, (), warnings, missing="", extra="")  # image inputs: warned as unused
    extra.setdefault("max_sequence_length", int(d.get("max_sequence_length", 0)))
    return params_type(task=request.task, prompt=prompt, negative_prompt=negative, steps=steps,
                       guidance_scale=float(policies.guidance_scale), policies=policies, warnings=tuple(warnings),
                       steps_path=steps_path, **sizes, **extra), warnings


def set_knobs(structured: Any, raw: Any) -> dict[str, Any]:
    """The node params a request set (the validated object, or the raw mapping), as a dict."""
    if structured is not None:
        return {k: v for k, v in attrs.asdict(structured, recurse=False).items() if v is not None}
    return dict(raw) if isinstance(raw, dict) else {}


__all__ = ["I2I_ROLES", "MAX_T5_TOKENS", "NEEDS_I2I_IMAGE", "ImageParams", "TextParams", "check_task",
           "clip_t5_warnings", "conditioning_image", "denoise_policies", "i2i_image", "i2i_strength", "image_size",
           "one_frame", "require_prompt", "resolve_image", "set_knobs", "text_params", "token_warning"]
