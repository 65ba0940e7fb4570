"""Incremental decoding with Wan's causal VAE: one latent chunk at a time, same frames as a
whole-clip decode.

``AutoencoderKLWan.decode`` already walks the latents one frame at a time, carrying a *feature
cache* (the last frames every causal conv needs) from frame to frame; it just clears that cache
at the start and end of each call. :class:`StreamingDecoder` keeps its own feature cache (per
stream, never on the shared module, so concurrent streams do not collide) across calls, so
decoding chunk after chunk runs exactly the per-frame calls of one full decode. The first latent
frame gives 1 video frame, each later one ``temporal compression`` (4) frames.

Tiled decoding is not used (the streamed chunks are decoded whole); latents are de-normalised
with the VAE's ``latents_mean`` / ``latents_std`` as the Wan pipeline does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..stages import denormalise


class StreamingDecoder:
    """Decode latent chunks ``[1, z, f, h, w]`` (normalised, as the transformer sees them) in order."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.frames_in = 0  # latent frames decoded so far
        self._feat: list[Any] = [None] * vae._cached_conv_counts["decoder"]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The video ``[1, 3, T, H, W]`` in [-1, 1] of the next latent frames ``latents``."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae = self.vae
        dev = next(vae.parameters()).device
        z = denormalise(self.vae, latents.to(dev, dtype=vae.dtype))
        x = vae.post_quant_conv(z)
        outs = []
        for i in range(x.shape[2]):
            idx = [0]
            first = self.frames_in == 0
            outs.append(vae.decoder(x[:, :, i : i + 1], feat_cache=self._feat, feat_idx=idx, first_chunk=first))
            self.frames_in += 1
        out = torch.cat(outs, 2)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0)

    def full_decode_reference(self, latents: torch.Tensor) -> torch.Tensor:
        """What the Wan pipeline's decode gives for the whole clip (for tests / parity)."""
        vae = self.vae
        dev = next(vae.parameters()).device
        with torch.no_grad():
            return vae.decode(denormalise(self.vae, latents.to(dev, dtype=vae.dtype)), return_dict=False)[0]

    def state_bytes(self) -> int:
        """Bytes held by the feature cache (what a session keeps between requests)."""
        return sum(t.numel() * t.element_size() for t in self._feat if isinstance(t, torch.Tensor))


__all__ = ["StreamingDecoder"]
