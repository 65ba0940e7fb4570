"""Action-conditioned requests (``OmniRequest.action``, diffusers' ``CosmosActionCondition``):
resolved here, once — the mode's needs checked, the embodiment domain's id and action width, the
conditioning canvas of the resolution tier, the structured JSON caption the action model was
trained on — and the conditioning clip padded onto that canvas for the VAE encoder.

The model's own conventions (domain ids, action widths, canvases per tier, viewpoint sentences,
the JSON caption) are read from diffusers' Cosmos 3 pipeline module, the reference, not copied.
Modes: ``policy`` (video and actions rolled out from the first frame, an image part, task
``i2v``; the actions are returned in ``artifacts["action"]``), ``forward_dynamics`` (the video
rolled out under given ``raw_actions``, task ``i2v``) and ``inverse_dynamics`` (the actions between
a video's frames: a video part, task ``v2v``; every latent frame of the video is kept clean).
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from omniloop.errors import RequestError
from omniloop.request import OmniRequest, TaskType


def _tables() -> Any:
    from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as ref

    return ref


@define(frozen=True)
class ActionSpec:
    """An action request resolved: mode, chunk, domain (name, id, width), canvas, raw actions, caption."""

    mode: str
    chunk_size: int
    domain: str
    domain_id: int
    #: the domain's unpadded action width (the model's head is ``action_dim`` wide; the rest is zero)
    width: int
    tier: int
    #: the conditioning canvas (height, width) the tier picks for the image's aspect
    canvas: tuple[int, int]
    raw_actions: tuple[tuple[float, ...], ...] | None
    view_point: str

    def vision_condition_frames(self, latent_frames: int) -> list[int]:
        """Latent video frames kept clean: every one for inverse dynamics, else the first."""
        return list(range(latent_frames)) if self.mode == "inverse_dynamics" else [0]

    @property
    def condition_frames(self) -> list[int]:
        """Action frames given (clean): all of them for forward dynamics, none for a policy."""
        return list(range(self.chunk_size)) if self.mode == "forward_dynamics" else []

    @property
    def returns_actions(self) -> bool:
        return self.mode in ("policy", "inverse_dynamics")


def resolve_action(request: OmniRequest, model_config: dict[str, Any], image: torch.Tensor | None,
                   warnings: list[str]) -> ActionSpec:
    """Every check of an action request before compute (``RequestError`` naming the field)."""
    a = request.action
    assert a is not None
    ref = _tables()
    head = model_config["action"]
    if head is None:
        raise RequestError("action", "this checkpoint has no action head (its transformer has action_gen false)")
    if a.mode == "inverse_dynamics" and request.task is not TaskType.V2V:
        raise RequestError("task", "inverse_dynamics reads the actions off a video: task v2v with a video part")
    if a.mode != "inverse_dynamics" and request.task is not TaskType.I2V:
        raise RequestError("task", f"an action request ({a.mode}) is image-conditioned: task i2v with the first frame "
                           "as an image part")
    d = request.diffusion
    for name in ("frames", "height", "width"):
        if getattr(d, name) is not None:
            raise RequestError(f"diffusion.{name}", "an action request's frames are action.chunk_size + 1 and its "
                               "size comes from the image and action.resolution_tier; leave it unset")
    if a.domain not in ref._EMBODIMENT_TO_DOMAIN_ID:
        raise RequestError("action.domain", f"unknown embodiment domain {a.domain!r} (one of "
                           f"{', '.join(sorted(ref._EMBODIMENT_TO_DOMAIN_ID))})")
    width = ref._EMBODIMENT_TO_RAW_ACTION_DIM.get(a.domain)
    if width is None:
        raise RequestError("action.domain", f"{a.domain!r} has no fixed action width, so actions cannot be read in it "
                           f"(domains with one: {', '.join(sorted(ref._EMBODIMENT_TO_RAW_ACTION_DIM))})")
    domain_id = ref._EMBODIMENT_TO_DOMAIN_ID[a.domain]
    if width > head["dim"]:
        raise RequestError("action.domain", f"{a.domain!r} actions are {width} wide; this checkpoint's action head "
                           f"is {head['dim']} wide")
    if domain_id >= head["domains"]:
        raise RequestError("action.domain", f"{a.domain!r} is domain {domain_id}; this checkpoint's action head has "
                           f"{head['domains']} domains")
    if a.mode == "forward_dynamics":
        if a.raw_actions is None:
            raise RequestError("action.raw_actions", "forward_dynamics rolls the video out under given actions: "
                               "raw_actions [T][D] is required")
        if len(a.raw_actions[0]) != width:
            raise RequestError("action.raw_actions", f"rows are {len(a.raw_actions[0])} wide; {a.domain!r} actions "
                               f"are {width} wide")
    elif a.raw_actions is not None:
        raise RequestError("action.raw_actions", f"only forward_dynamics reads raw_actions ({a.mode} predicts them)")
    if a.view_point not in ref._ACTION_VIEWPOINT_TEMPLATES:
        warnings.append(f"action.view_point {a.view_point!r} is not one the model knows "
                        f"({', '.join(sorted(ref._ACTION_VIEWPOINT_TEMPLATES))}): the caption has no framing")
    canvas = (0, 0)
    if image is not None:  # an image [H, W, 3] or a video [T, H, W, 3]
        sf = model_config["vae_scale_spatial"]
        h, w = int(image.shape[-3]), int(image.shape[-2])
        canvas = classify(h - h % sf, w - w % sf, a.resolution_tier)
    raw = tuple(tuple(float(v) for v in row) for row in a.raw_actions) if a.raw_actions is not None else None
    return ActionSpec(mode=a.mode, chunk_size=a.chunk_size, domain=a.domain, domain_id=domain_id, width=width,
                      tier=a.resolution_tier, canvas=canvas, raw_actions=raw, view_point=a.view_point)


def classify(height: int, width: int, tier: int) -> tuple[int, int]:
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor.classify_height_width_bin(height, width, ratios=_tables()._ACTION_RESOLUTION_BINS[str(tier)])


def caption(prompt: str, spec: ActionSpec, fps: float) -> str:
    """The structured JSON caption of an action request (the pipeline's own builder)."""
    from diffusers import Cosmos3OmniPipeline

    view = spec.view_point if spec.view_point in _tables()._ACTION_VIEWPOINT_TEMPLATES else None
    return str(Cosmos3OmniPipeline._build_action_json_prompt(prompt, view_point=view, num_frames=spec.chunk_size + 1,
                                                             fps=fps, height=spec.canvas[0], width=spec.canvas[1]))


def conditioning_clip(frames_in: torch.Tensor, spec: ActionSpec, vae_scale: int, device: Any
                      ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The conditioning frames (uint8 ``[H, W, 3]``, or a video ``[T, H, W, 3]``) cut or padded
    with their last frame to ``chunk_size + 1`` frames, scaled down (never up) into the tier's
    canvas and padded right/bottom (replicate when the pad is as wide as the content, else
    reflect): ``[1, 3, F, H, W]`` in [-1, 1], and the content's (height, width)."""
    import numpy as np
    import torch.nn.functional as F
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    clip = frames_in.unsqueeze(0) if frames_in.ndim == 3 else frames_in
    frames = VideoProcessor(vae_scale_factor=vae_scale, resample="bilinear").preprocess_video(
        [Image.fromarray(np.asarray(f.cpu())) for f in clip]).to(device=device, dtype=torch.float32)
    n = spec.chunk_size + 1
    if frames.shape[2] < n:
        frames = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, n - frames.shape[2], -1, -1)], dim=2)
    else:
        frames = frames[:, :, :n]
    th, tw = spec.canvas
    _, c, _, fh, fw = frames.shape
    scale = min(tw / fw, th / fh, 1.0)
    ch, cw = max(1, int(scale * fh + 0.5)), max(1, int(scale * fw + 0.5))
    flat = frames.permute(0, 2, 1, 3, 4).reshape(-1, c, fh, fw)
    if (ch, cw) != (fh, fw):
        flat = F.interpolate(flat, size=(ch, cw), mode="bicubic", align_corners=False, antialias=True)
    pad_r, pad_b = tw - cw, th - ch
    if pad_r or pad_b:
        flat = F.pad(flat, (0, pad_r, 0, pad_b), mode="replicate" if pad_r >= cw or pad_b >= ch else "reflect")
    return flat.reshape(1, n, c, th, tw).permute(0, 2, 1, 3, 4), (ch, cw)


__all__ = ["ActionSpec", "caption", "classify", "conditioning_clip", "resolve_action"]
