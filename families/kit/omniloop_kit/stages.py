"""Stage helpers the diffusers-format families share: the image artifact, where a module's
weights are, the VAE's scale, the resolved params on the ``params`` edge, and the output stage's
latents return (``outputs.return_latents``)."""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from omniloop.artifacts import Conditioning, Image, Latents
from omniloop.context import StageContext
from omniloop.loop import RequestState


@define(kw_only=True)
class ImageFrames(Image):
    """uint8 pixels ``[H, W, 3]`` on the CPU (the core's ``Image``, read by the server and the CLI);
    ``frames`` is the same picture as one frame ``[1, H, W, 3]``."""

    @property
    def frames(self) -> torch.Tensor:
        return self.pixels.unsqueeze(0)


def module_device(module: Any) -> torch.device:
    """The device of ``module``'s first parameter (CPU for a module without parameters)."""
    try:
        return next(module.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def vae_scale_factor(vae: Any) -> int:
    """A diffusers ``AutoencoderKL``'s spatial downscale (8 for four blocks)."""
    return int(2 ** (len(vae.config.block_out_channels) - 1))


def params_of(state: RequestState) -> Any:
    """The request's resolved params, as the ``validate`` node wrote them on the ``params`` edge."""
    return state.read("params", Conditioning).values["params"]


def return_latents(ctx: StageContext, state: RequestState, modality: str) -> None:
    """The output stage's ``latents`` artifact (the ``denoised`` edge, on the CPU) when the request
    asks for it (``outputs.return_latents``; a family that cannot serve it does not declare
    ``returns_latents`` and the core refuses the request)."""
    if state.request.outputs.return_latents:
        lat = state.read("denoised", Latents).tensor
        state.write("latents", Latents(tensor=lat.detach().cpu(), modality=modality), ctx.node.name)


__all__ = ["ImageFrames", "module_device", "params_of", "return_latents", "vae_scale_factor"]
