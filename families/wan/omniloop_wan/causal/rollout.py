"""Wan's causal chunk rollout: omniloop-kit's :class:`~omniloop_kit.causal.CausalEngine` over Wan's
chunk forward (:mod:`.model`), its KV layout (:func:`.kv.chunk_layout`) and its streaming VAE
decoder (:class:`.vae.StreamingDecoder`); the schedule, the slabs, CFG and the uncached oracle are
the kit's (its module docstring says how a chunk is denoised).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop_kit.causal import CausalEngine, CausalOptions, ChunkOut, Stream, chunk_noise

from .kv import chunk_layout
from .model import check_model, chunk_forward, masked_forward
from .vae import StreamingDecoder


class CausalWan(CausalEngine):
    """Chunk rollout of one Wan transformer (+ optional VAE) at one latent size."""

    decoder = StreamingDecoder
    chunk_forward = staticmethod(chunk_forward)
    masked_forward = staticmethod(masked_forward)
    check_model = staticmethod(check_model)
    kv_layout = staticmethod(chunk_layout)


def encode_first_frame(vae: Any, image: torch.Tensor) -> torch.Tensor:
    """The normalised latents ``[1, z, 1, h, w]`` (as the transformer sees them) of one image
    ``[1, 3, H, W]`` in [-1, 1]: the causal VAE encodes a first frame on its own (posterior mode,
    then ``(z - latents_mean) / latents_std`` as the Wan pipelines do)."""
    if image.ndim != 4 or image.shape[0] != 1 or image.shape[1] != 3:
        raise ValueError(f"image: expected [1, 3, H, W] in [-1, 1], got {list(image.shape)}")
    if not torch.isfinite(image).all():
        raise ValueError("image: has non-finite values")
    p = next(vae.parameters())
    with torch.no_grad():
        z = vae.encode(image[:, :, None].to(p.device, p.dtype)).latent_dist.mode()
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return (z - mean) / std


__all__ = ["CausalOptions", "CausalWan", "ChunkOut", "Stream", "chunk_noise", "encode_first_frame"]
