"""The one-shot nodes of the ``t2v`` pipeline: ``validate`` → denoise → ``vae_decode`` → ``output``.

``vae_decode`` is diffusers' un-normalisation (``z / inv_std + mean`` in the VAE's dtype) and Wan
VAE decode; ``output`` turns ``[1, 3, T, H, W]`` in [-1, 1] into uint8 frames the way diffusers'
video processor makes PIL frames (``(x / 2 + 0.5).clamp(0, 1)``, float32, ``* 255``, rounded).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from omniloop.artifacts import Action, Audio, Latents, Tensors, VideoFrames
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop_kit import stages as kit
from omniloop_kit.stages import module_device, params_of, return_latents

from .resolve import Cosmos3Resolved, resolve


class Validate(kit.Validate):
    """The request's resolved parameters onto the ``params`` edge."""

    params_type = Cosmos3Resolved

    def resolve(self, request: Any, limits: Any) -> tuple[Any, list[str]]:
        p = resolve(self.model, request)
        return p, list(p.warnings)


def first_frame(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 ``[H0, W0, 3]`` → ``[1, 3, height, width]`` in [-1, 1]: scaled to cover the frame
    (bilinear, antialiased), centre-cropped, rounded (the pipeline's conditioning-image preprocessing)."""
    import torch.nn.functional as F

    x = image.permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    h0, w0 = x.shape[-2:]
    scale = max(width / w0, height / h0)
    rh, rw = math.ceil(scale * h0), math.ceil(scale * w0)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    top, left = round((rh - height) / 2), round((rw - width) / 2)
    x = x[:, :, top:top + height, left:left + width]
    return x.round().clamp(0, 255) / 127.5 - 1.0


def video_clip(p: Cosmos3Resolved, spatial: int, temporal: int, device: Any) -> torch.Tensor:
    """v2v: the video resized to the frame (diffusers' video processor), the frames of the kept
    latent frames placed first and the rest repeat-padded with the last of them: ``[1, 3, F, H, W]``."""
    import numpy as np
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    from .resolve import V2V_CONDITION_FRAMES

    cond = VideoProcessor(vae_scale_factor=spatial, resample="bilinear").preprocess_video(
        [Image.fromarray(np.asarray(f.cpu())) for f in p.video], height=p.height, width=p.width
    ).to(device=device, dtype=torch.float32)
    cond = cond[:, :, :max(V2V_CONDITION_FRAMES) * temporal + 1]
    clip = torch.zeros(1, 3, p.num_frames, p.height, p.width, dtype=torch.float32, device=device)
    n = min(cond.shape[2], p.num_frames)
    clip[:, :, :n] = cond[:, :, :n]
    if n < p.num_frames:
        clip[:, :, n:] = clip[:, :, n - 1:n].expand(-1, -1, p.num_frames - n, -1, -1)
    return clip


def vae_stats(vae: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and 1 / std as ``[1, z, 1, 1, 1]`` in its dtype."""
    dtype = vae.dtype
    mean = torch.tensor(vae.config.latents_mean, dtype=dtype).to(device=device, dtype=dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std, dtype=dtype)).to(device=device, dtype=dtype)
    return mean.view(1, -1, 1, 1, 1), inv_std.view(1, -1, 1, 1, 1)


class ImageEncode:
    """i2v: the first frame repeated over every frame of the clip, through the VAE encoder (its
    mode), normalised — the clean latents whose first frame conditions the video."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: Cosmos3Resolved = params_of(state)
        vae = ctx.components["vae"]
        content = None
        if p.action is not None:  # the clip on the tier's canvas; the latents cropped back to the content
            from .action import conditioning_clip

            clip, content = conditioning_clip(p.image, p.action, int(vae.config.scale_factor_spatial), ctx.device)
        elif p.video is not None:
            clip = video_clip(p, int(vae.config.scale_factor_spatial), int(vae.config.scale_factor_temporal),
                              ctx.device)
        else:
            frame = first_frame(p.image, p.height, p.width).to(device=ctx.device)
            clip = torch.zeros(1, 3, p.num_frames, p.height, p.width, dtype=torch.float32, device=ctx.device)
            clip[:, :, 0] = frame
            if p.num_frames > 1:
                clip[:, :, 1:] = frame.unsqueeze(2).expand(-1, -1, p.num_frames - 1, -1, -1)
        with torch.no_grad():
            mu = vae.encode(clip.to(device=module_device(vae), dtype=vae.dtype)).latent_dist.mode()
            mean, inv_std = vae_stats(vae, mu.device)
            x0 = ((mu - mean) * inv_std).to(clip.dtype).contiguous().float()
        if content is not None:
            sf = int(vae.config.scale_factor_spatial)
            x0 = x0[:, :, :, :max(content[0] // sf, 1), :max(content[1] // sf, 1)].contiguous()
        state.write("image_latents", Latents(tensor=x0.to(ctx.device), modality="video"), ctx.node.name)


class VaeDecode:
    """Normalised latents ``[1, z, T, H, W]`` → video ``[1, 3, T', H', W']`` in [-1, 1]."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            mean, inv_std = vae_stats(vae, latents.device)
            z = latents.to(vae.dtype) / inv_std + mean
            video = vae.decode(z.to(module_device(vae))).sample.to(latents.dtype)
        state.write("decoded", Tensors(values={"video": video}), ctx.node.name)


class SoundDecode:
    """Sound latents ``[C, T]`` → waveform ``[channels, T * hop]`` (the sound tokenizer's decoder;
    like diffusers, padded to whole decoder hops and not trimmed to the video's length)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        st = ctx.components["sound_tokenizer"]
        latents = state.read("denoised_sound", Latents).tensor
        with torch.no_grad():
            dtype = next(st.parameters()).dtype
            wave = st.decode(latents.unsqueeze(0).to(device=module_device(st), dtype=dtype)).squeeze(0)
        state.write("waveform", Tensors(values={"audio": wave}), ctx.node.name)


class Output:
    """``video`` (uint8 ``[T, H, W, 3]`` at the request's fps), ``audio`` with a sound track, and on
    request ``latents`` (and ``sound_latents``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: Cosmos3Resolved = params_of(state)
        video = state.read("decoded", Tensors).values["video"][0]
        x = (video / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).float().cpu()
        frames = (x * 255).round().to(torch.uint8).contiguous()
        state.write("video", VideoFrames(frames=frames, fps=p.fps), ctx.node.name)
        wave = state.get("waveform")
        if isinstance(wave, Tensors):
            rate = int(ctx.components["sound_tokenizer"].config.sampling_rate)
            samples = wave.values["audio"].float().cpu().contiguous()
            state.write("audio", Audio(samples=samples, sample_rate=rate), ctx.node.name)
        return_latents(ctx, state, "video")
        actions = state.get("denoised_action")
        if isinstance(actions, Latents) and p.action is not None and p.action.returns_actions:
            values = actions.tensor[:, :p.action.width].detach().float().cpu()
            state.write("action", Action(values=values, domain=p.action.domain), ctx.node.name)
        sound = state.get("denoised_sound")
        if state.request.outputs.return_latents and isinstance(sound, Latents):
            state.write("sound_latents", Latents(tensor=sound.tensor.detach().cpu(), modality="audio"), ctx.node.name)


__all__ = ["ImageEncode", "Output", "SoundDecode", "VaeDecode", "Validate", "first_frame", "vae_stats"]
