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

from omniloop.errors import RequestError
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest, TaskType
from omniloop.resolved import Workload, bounds
from omniloop_kit import resolve as kit

from .defaults import TEXT_LEN


@attrs.define(frozen=True, kw_only=True)
class WanParams(kit.ImageParams):
    """A request's resolved parameters (defaults applied, sizes checked): omniloop-kit's
    :class:`~omniloop_kit.resolve.ImageParams` with the video's frames and fps and the flow shift the
    request asked for; the negative prompt is always encoded (default ``""``), every prompt padded
    to 512 tokens. ``policies``: the request's ``omniloop_policies.DenoisePolicies`` (sampler, CFG
    policy, router, scales) — from ``node_params.denoise`` > ``diffusion`` > defaults."""

    negative_prompt: str = ""
    frames: int
    fps: float
    shift: float | None = None
    max_sequence_length: int = TEXT_LEN

    def workload(self) -> Workload:
        """The scheduler's size of this request (guidance branches before the CFG policy's init);
        ``bounded``: what the runtime checks against the deploy's limits."""
        return Workload(steps=self.steps, branches=self.branches(), frames=self.frames, height=self.height,
                        width=self.width, bounded=bounds(steps=self.steps, frames=self.frames, height=self.height,
                                                         width=self.width, steps_path=self.steps_path))


#: image roles the I2V pipelines condition on (the first frame)
FIRST_FRAME_ROLES = ("image", "first_frame")


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
    kit.check_task(request.task, cfg["tasks"], f"this {cfg['kind']} checkpoint")
    defaults = cfg["defaults"]
    d = request.diffusion
    prompt = kit.require_prompt(request)
    negative = request.negative_prompt
    if negative is None:
        negative = defaults.get("negative_prompt", "")

    # the denoise policies: node_params.denoise > diffusion > the model's defaults
    if menu is None:
        from .policies import menu_for

        menu = menu_for(model)
    policies, steps, steps_path = kit.denoise_policies(menu, request, (node_params or {}).get(menu.node))

    t_scale = cfg["vae_scale_temporal"]
    frames = d.frames if d.frames is not None else int(defaults["frames"])
    if frames < 1 or (frames - 1) % t_scale:
        lo = (max(frames, 1) - 1) // t_scale * t_scale + 1
        raise RequestError(
            "diffusion.frames",
            f"must be of the form {t_scale}k+1 (1, {1 + t_scale}, {1 + 2 * t_scale}, ...), got {frames}; "
            f"try {lo} or {lo + t_scale}",
        )
    sizes = {name: kit.image_size(request, name, defaults[name], cfg["size_multiple"], warnings)
             for name in ("height", "width")}
    fps = d.fps if d.fps is not None else float(defaults.get("fps", 16.0))
    image = kit.conditioning_image(
        request, request.task is TaskType.I2V, FIRST_FRAME_ROLES, warnings, decode=decode_image,
        missing="an i2v request needs an image (an image part with role 'image' or 'first_frame')",
        extra="{n} more image input(s) ignored ({roles}): Wan conditions on one first frame "
              "(last-frame and reference images are not supported yet)")
    for field, text in (("prompt", prompt), ("negative prompt", negative)):
        kit.token_warning(model.components.get("tokenizer"), text, TEXT_LEN, field, "UMT5", warnings, clean=_clean)

    params = WanParams(
        task=request.task, prompt=prompt, negative_prompt=negative, height=sizes["height"], width=sizes["width"],
        frames=frames, steps=steps, guidance_scale=float(policies.guidance_scale), shift=policies.requested_shift,
        fps=float(fps), image=image, policies=policies, warnings=tuple(warnings), steps_path=steps_path,
    )
    return params, warnings


def _clean(text: str) -> str:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return str(prompt_clean(text))
