"""Request validation and default resolution, shared by ``validate_request`` and the validate node.

Every check raises :class:`omniloop.errors.RequestError` naming the field (``diffusion.height``,
``inputs[0].path``, ``node_params.denoise.strength``) before any compute; soft problems (a size
rounded down, a truncated prompt, a negative prompt this model does not use) come back as warnings.
The skeleton is omniloop-kit's (:mod:`omniloop_kit.resolve`); FLUX's own are its rules for
strength, true CFG and the embedded guidance.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from attrs import define, field

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType
from omniloop.schema import structure_params
from omniloop_kit import resolve as kit
from omniloop_kit.inputs import count_tokens as kit_count_tokens
from omniloop_kit.inputs import image_part

from .defaults import MAX_SEQUENCE_LENGTH


@define(frozen=True)
class TextParams:
    """Per-request knobs of the ``text_encode`` node (``node_params.text_encode``)."""

    #: T5 tokens the prompt is padded/truncated to (diffusers' ``max_sequence_length``, at most 512)
    max_sequence_length: int | None = field(default=None, metadata={"ge": 1, "le": MAX_SEQUENCE_LENGTH})


@attrs.define(frozen=True, kw_only=True)
class FluxParams(kit.ImageParams):
    """A request's resolved parameters (defaults applied, sizes rounded as diffusers does)."""

    #: what the guidance embedding gets (guidance-distilled checkpoints): the guidance scale with CFG
    #: ``embedded``, the task's default guidance with ``classic`` (whose scale is the true-CFG scale)
    embedded_guidance: float = 3.5

    def branches(self) -> int:
        """Two forwards per step with true CFG (a negative prompt encoded), else one."""
        return 2 if self.negative_prompt is not None else 1


#: image roles an i2i request's input image may have (the first such part is used)
IMAGE_ROLES = ("image", "reference", "first_frame")
NEEDS_IMAGE = "an i2i request needs an input image (an image part with role 'image')"


def load_image_part(request: OmniRequest) -> torch.Tensor:
    """Decode the request's input image (the first part with a role in :data:`IMAGE_ROLES`)."""
    got = image_part(request, IMAGE_ROLES)
    if got is None:
        raise RequestError("inputs", NEEDS_IMAGE)
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
    """Check ``request`` against ``model``; return its resolved params and warnings (``limits`` are
    the runtime's to check, on the result).

    ``node_params``: the request's node params as the core validated them (``Runtime.prepare``,
    ``FluxFamily.resolve``); without them (a stage driven by hand) the same converter runs here."""
    cfg = model.config
    warnings: list[str] = []
    kit.check_task(request.task, cfg["tasks"], "the FLUX.1 family")
    defaults = cfg["defaults"]
    i2i = request.task is TaskType.I2I
    prompt = kit.require_prompt(request)
    kit.one_frame(request)

    if menu is None:
        from .policies import menu_for

        menu = menu_for(model)
    structured = (node_params or {}).get(menu.node)
    policies, steps, steps_path = kit.denoise_policies(menu, request, structured)  # validates node_params.denoise
    denoise_params = kit.set_knobs(structured, (request.node_params or {}).get(menu.node))
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
        from omniloop_policies import strength_steps

        if strength_steps(steps, strength) < 1:
            raise RequestError(
                f"node_params.{menu.node}.strength",
                f"strength {strength} of {steps} steps leaves no step to run; raise strength or steps",
            )
    elif strength is not None:
        raise RequestError(f"node_params.{menu.node}.strength", "strength applies to i2i requests only")

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

    sizes = {name: kit.image_size(request, name, defaults[name], cfg["size_multiple"], warnings, round_down=True)
             for name in ("height", "width")}
    tp = (node_params or {}).get("text_encode") or text_params(request)
    max_len = int(tp.max_sequence_length or defaults["max_sequence_length"])
    image = kit.conditioning_image(request, i2i, IMAGE_ROLES, warnings, decode=decode_image, missing=NEEDS_IMAGE,
                                   extra="{n} more image input(s) ignored: FLUX.1 i2i takes one image")
    tok = model.components.get("tokenizer")
    kit.token_warning(tok, prompt, int(getattr(tok, "model_max_length", 77)), "prompt", "CLIP", warnings)
    kit.token_warning(model.components.get("tokenizer_2"), prompt, max_len, "prompt", "T5", warnings)

    params = FluxParams(
        task=request.task, prompt=prompt, height=sizes["height"], width=sizes["width"], steps=steps,
        guidance_scale=float(policies.guidance_scale), max_sequence_length=max_len,
        strength=strength if i2i else None, image=image, policies=policies, negative_prompt=negative,
        embedded_guidance=embedded, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


def _no_scale(request: OmniRequest, denoise_params: dict[str, Any]) -> bool:
    return request.diffusion.guidance_scale is None and denoise_params.get("guidance_scale") is None
