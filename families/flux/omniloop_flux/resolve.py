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

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType
from omniloop_kit import resolve as kit
from omniloop_kit.resolve import TextParams


@attrs.define(frozen=True, kw_only=True)
class FluxParams(kit.ImageParams):
    """A request's resolved parameters (defaults applied, sizes rounded as diffusers does)."""

    #: what the guidance embedding gets (guidance-distilled checkpoints): the guidance scale with CFG
    #: ``embedded``, the task's default guidance with ``classic`` (whose scale is the true-CFG scale)
    embedded_guidance: float = 3.5

    def branches(self) -> int:
        """Two forwards per step with true CFG (a negative prompt encoded), else one."""
        return 2 if self.negative_prompt is not None else 1


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
    policies = kit.i2i_strength(policies, i2i, steps, defaults["strength"], menu.node)
    if i2i and policies.guidance_scale == menu.default_guidance_scale and _no_scale(request, denoise_params):
        policies = attrs.evolve(policies, guidance_scale=float(defaults["i2i_guidance_scale"]))

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
    max_len = int(kit.text_params(request, node_params).max_sequence_length or defaults["max_sequence_length"])
    image = kit.i2i_image(request, i2i, warnings, decode=decode_image, who="FLUX.1")
    kit.clip_t5_warnings(model.components, [("prompt", prompt)], "tokenizer_2", max_len, warnings)

    params = FluxParams(
        task=request.task, prompt=prompt, height=sizes["height"], width=sizes["width"], steps=steps,
        guidance_scale=float(policies.guidance_scale), max_sequence_length=max_len,
        strength=policies.strength, image=image, policies=policies, negative_prompt=negative,
        embedded_guidance=embedded, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


def _no_scale(request: OmniRequest, denoise_params: dict[str, Any]) -> bool:
    return request.diffusion.guidance_scale is None and denoise_params.get("guidance_scale") is None


__all__ = ["FluxParams", "TextParams", "resolve"]
