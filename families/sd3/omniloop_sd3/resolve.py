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

from attrs import define

from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType
from omniloop.schema import structure_params
from omniloop_kit import resolve as kit
from omniloop_kit.resolve import TextParams
from omniloop_policies import DenoiseParams

from .policies import menu_for

#: ``node_params.denoise``: the policies' knobs, ``strength`` (i2i) among them
SD3DenoiseParams = DenoiseParams


@define(frozen=True, kw_only=True)
class SD3Params(kit.ImageParams):
    """A request's resolved parameters (omniloop-kit's :class:`~omniloop_kit.resolve.ImageParams`):
    the negative prompt is always encoded (default ``""``); two forwards per step when the guidance
    scale is above 1 (CFG)."""

    negative_prompt: str = ""


def resolve(
    model: LoadedModel, request: OmniRequest, limits: Any = None, *, decode_image: bool = True,
    node_params: Any = None,
) -> tuple[SD3Params, list[str]]:
    """Check ``request`` against ``model``; its resolved params and warnings (``limits`` are the
    runtime's to check, on the result).

    ``node_params``: the node params as the core validated them (``Runtime.prepare``); without
    them the same converter validates ``request.node_params`` here (types and ranges live in the
    attrs metadata of :class:`SD3DenoiseParams` / :class:`TextParams`, nowhere else)."""
    cfg = model.config
    task = request.task
    kit.check_task(task, cfg["tasks"], "the sd3 family")
    defaults = cfg["task_defaults"][task]
    warnings: list[str] = []
    prompt = kit.require_prompt(request)
    negative = request.negative_prompt
    if negative is None:
        negative = str(defaults.get("negative_prompt") or "")

    given = node_params or {}
    raw_params = request.node_params or {}
    dp = given.get("denoise")
    if dp is None:
        dp = structure_params(SD3DenoiseParams, raw_params.get("denoise"), "node_params.denoise")
    policies, steps, steps_path = kit.denoise_policies(menu_for(model, task), request, dp)

    sizes = {name: kit.image_size(request, name, defaults[name], cfg["size_multiple"], warnings, top=cfg["max_size"])
             for name in ("height", "width")}
    kit.one_frame(request)
    msl = kit.text_params(request, node_params).max_sequence_length or int(defaults["max_sequence_length"])

    i2i = task is TaskType.I2I  # the sampler runs the last ``strength`` of the schedule (diffusers' get_timesteps)
    policies = kit.i2i_strength(policies, i2i, steps, defaults.get("strength", 0.6))
    image = kit.i2i_image(request, i2i, warnings, decode=decode_image, who="SD3")
    kit.clip_t5_warnings(model.components, [("prompt", prompt), ("negative prompt", negative)], "tokenizer_3", msl,
                         warnings)

    params = SD3Params(
        task=task, prompt=prompt, negative_prompt=negative, height=sizes["height"], width=sizes["width"],
        steps=steps, guidance_scale=float(policies.guidance_scale), max_sequence_length=int(msl),
        strength=policies.strength, image=image, policies=policies, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


__all__ = ["SD3DenoiseParams", "SD3Params", "TextParams", "resolve"]
