"""The one-shot nodes of the ``t2v`` pipeline: ``validate`` → denoise → ``vae_decode`` → ``output``.

``vae_decode`` is diffusers' un-normalisation (``z / inv_std + mean`` in the VAE's dtype) and Wan
VAE decode; ``output`` turns ``[1, 3, T, H, W]`` in [-1, 1] into uint8 frames the way diffusers'
video processor makes PIL frames (``(x / 2 + 0.5).clamp(0, 1)``, float32, ``* 255``, rounded).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Audio, Latents, Tensors, VideoFrames
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


class VaeDecode:
    """Normalised latents ``[1, z, T, H, W]`` → video ``[1, 3, T', H', W']`` in [-1, 1]."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        cfg = vae.config
        with torch.no_grad():
            dev, dtype = latents.device, vae.dtype
            mean = torch.tensor(cfg.latents_mean, dtype=dtype).to(device=dev, dtype=dtype)
            inv_std = (1.0 / torch.tensor(cfg.latents_std, dtype=dtype)).to(device=dev, dtype=dtype)
            z = latents.to(dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
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
        sound = state.get("denoised_sound")
        if state.request.outputs.return_latents and isinstance(sound, Latents):
            state.write("sound_latents", Latents(tensor=sound.tensor.detach().cpu(), modality="audio"), ctx.node.name)


__all__ = ["Output", "SoundDecode", "VaeDecode", "Validate"]
