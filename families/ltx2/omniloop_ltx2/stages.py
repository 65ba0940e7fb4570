"""The nodes of the ``t2v`` / ``i2v`` pipelines around the denoise loop: ``validate`` →
``text_encode`` (→ ``image_encode``: i2v's first frame) → ``denoise`` → ``video_decode`` and ``audio_decode`` (fan-out: both read the denoise node's two
latent streams) → ``output`` (the muxable pair: ``video`` and ``audio``).

Each stage does what diffusers' ``LTX2Pipeline`` does at that point with the same tensor
operations (its static packing helpers are called as they are), so the results match diffusers bit
for bit on CPU in float32 (tests/ltx2/test_parity.py).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Audio, Embeddings, Latents, Tensors, VideoFrames
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop_kit.stages import Validate as KitValidate
from omniloop_kit.stages import module_device, params_of

from .resolve import LTX2Resolved


class Validate(KitValidate):
    """The resolved params onto the ``params`` edge (the kit's ``validate`` node)."""

    params_type = LTX2Resolved

    def resolve(self, request: Any, limits: Any) -> tuple[Any, list[str]]:
        from .family import LTX2Family

        return LTX2Family().resolve_request(self.model, request, limits)  # node_params.denoise structured there


def pipeline_class() -> Any:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline


def gemma_states(components: dict[str, Any], text: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``_get_gemma_prompt_embeds`` for one text: left-padded to ``max_length`` (the
    tokenizer is set to left padding at load), every hidden state of the text encoder stacked and
    flattened ``[1, L, D * (layers + 1)]`` in the encoder's dtype, and the attention mask."""
    tok, te = components["tokenizer"], components["text_encoder"]
    inp = tok([text.strip()], padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
              return_tensors="pt")
    dev = module_device(te)
    ids, mask = inp.input_ids.to(dev), inp.attention_mask.to(dev)
    out = te(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(dtype=te.dtype)
    return states, mask


class TextEncode:
    """Prompt (and, with CFG, the negative prompt: rows ``[negative, prompt]``) → the connectors'
    video and audio text states and their mask (``conditioning``: ``tensor`` the video states,
    ``extra["audio"]``, ``extra["mask"]``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: LTX2Resolved = params_of(state)
        comps = ctx.components
        with torch.no_grad():
            states, mask = gemma_states(comps, p.prompt, p.max_sequence_length)
            if p.cfg:
                neg, neg_mask = gemma_states(comps, p.negative_prompt, p.max_sequence_length)
                states, mask = torch.cat([neg, states], dim=0), torch.cat([neg_mask, mask], dim=0)
            conn = comps["connectors"]
            dev = module_device(conn)
            video, audio, cmask = conn(states.to(dev), mask.to(dev), padding_side="left")
        state.write("conditioning", Embeddings(tensor=video.to(ctx.device), extra={"audio": audio.to(ctx.device),
                                                                                  "mask": cmask.to(ctx.device)}),
                    ctx.node.name)


class ImageEncode:
    """i2v: the first frame → its normalised VAE latents ``[1, C, 1, h, w]`` (``image_latents``), as
    diffusers' ``LTX2ImageToVideoPipeline`` does: re-compressed as H.264 at the request's CRF (as the
    model was trained; 0: not), ``VideoProcessor(resample="bilinear").preprocess`` at the request's size, the VAE's mode
    (``argmax``: nothing drawn), normalised with ``latents_mean`` / ``latents_std``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        import numpy as np
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from diffusers.video_processor import VideoProcessor
        from PIL import Image as PILImage

        from omniloop_io.media import to_pil

        p: LTX2Resolved = params_of(state)
        if p.image is None:
            raise RuntimeError("image_encode: the request's image was not decoded")
        vae = ctx.components["vae"]
        emb_dtype = ctx.components["text_encoder"].dtype
        image = to_pil(p.image)
        if p.image_crf != 0:
            image = PILImage.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), p.image_crf))
        with torch.no_grad():
            pixels = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear").preprocess(
                image, height=p.height, width=p.width).to(device=module_device(vae), dtype=emb_dtype)
            dist = vae.encode(pixels[0].unsqueeze(0).unsqueeze(2)).latent_dist
            lat = dist.mode().to(torch.float32)
            lat = pipeline_class()._normalize_latents(lat, vae.latents_mean, vae.latents_std)
        state.write("image_latents", Tensors(values={"latents": lat.to(ctx.device)}), ctx.node.name)


def video_latents(ctx: StageContext, p: LTX2Resolved, packed: torch.Tensor) -> torch.Tensor:
    """The packed video stream ``[1, S, C]`` → ``[1, C, F, H, W]`` (still normalised)."""
    tf = ctx.components["transformer"]
    return pipeline_class()._unpack_latents(packed, p.latent_frames, p.latent_height, p.latent_width,
                                            tf.config.patch_size, tf.config.patch_size_t)


def audio_latents(ctx: StageContext, p: LTX2Resolved, packed: torch.Tensor) -> torch.Tensor:
    """The packed audio stream → denormalised ``[1, C, L, M]`` (what the audio VAE decodes)."""
    avae = ctx.components["audio_vae"]
    lat = pipeline_class()._denormalize_audio_latents(packed, avae.latents_mean, avae.latents_std)
    return pipeline_class()._unpack_audio_latents(lat, p.audio_frames, num_mel_bins=avae.config.mel_bins // avae.mel_compression_ratio)


class VideoDecode:
    """The video stream through the video VAE: un-normalised (``latents_mean`` / ``latents_std`` /
    ``scaling_factor``), decoded (with diffusers' decode timestep 0 and noise scale 0 — the noise
    drawn from the request's generator as diffusers draws it — when the VAE is timestep-
    conditioned), ``[B, F, 3, H, W]`` in [0, 1] (``decoded["video"]``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        from diffusers.utils.torch_utils import randn_tensor
        from diffusers.video_processor import VideoProcessor

        from omniloop_kit.denoise import request_generator

        p: LTX2Resolved = params_of(state)
        vae = ctx.components["vae"]
        emb = state.read("conditioning", Embeddings).tensor
        with torch.no_grad():
            lat = video_latents(ctx, p, state.read("denoised", Latents).tensor).to(emb.dtype)
            timestep = None
            if vae.config.timestep_conditioning:
                noise = randn_tensor(lat.shape, generator=request_generator(state), device=lat.device, dtype=lat.dtype)
                timestep = torch.tensor([0.0], device=lat.device, dtype=lat.dtype)
                scale = torch.tensor([0.0], device=lat.device, dtype=lat.dtype)[:, None, None, None, None]
                lat = (1 - scale) * lat + scale * noise
            lat = pipeline_class()._denormalize_latents(lat, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            video = vae.decode(lat.to(module_device(vae), dtype=vae.dtype), timestep, return_dict=False)[0]
            video = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio).postprocess_video(video, output_type="pt")
        state.write("decoded_video", Tensors(values={"video": video}), ctx.node.name)


class AudioDecode:
    """The audio stream through the audio VAE (a mel spectrogram) and the vocoder: ``[1, channels, n]``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: LTX2Resolved = params_of(state)
        avae, vocoder = ctx.components["audio_vae"], ctx.components["vocoder"]
        with torch.no_grad():
            lat = audio_latents(ctx, p, state.read("audio_denoised", Latents).tensor)
            mel = avae.decode(lat.to(module_device(avae), dtype=avae.dtype), return_dict=False)[0]
            wave = vocoder(mel.to(module_device(vocoder)))
        state.write("decoded_audio", Tensors(values={"audio": wave}), ctx.node.name)


class Output:
    """``video`` (uint8 ``[F, H, W, 3]`` at the request's fps: diffusers' frames in [0, 1] times
    255, rounded), ``audio`` (float32 ``[channels, n]`` at the vocoder's rate); with
    ``outputs.return_latents`` ``latents`` ``[1, C, F, H, W]`` and ``audio_latents`` ``[1, C, L, M]``
    as diffusers' ``output_type="latent"`` returns them (denormalised, unpacked)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: LTX2Resolved = params_of(state)
        video = state.read("decoded_video", Tensors).values["video"][0]
        frames = (video.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()
        state.write("video", VideoFrames(frames=frames, fps=p.fps), ctx.node.name)
        wave = state.read("decoded_audio", Tensors).values["audio"][0].float().cpu().contiguous()
        rate = int(ctx.components["vocoder"].config.output_sampling_rate)
        state.write("audio", Audio(samples=wave, sample_rate=rate), ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("video", frames, None)
            ctx.tap("audio", wave, None)
        if state.request.outputs.return_latents:
            vae = ctx.components["vae"]
            lat = video_latents(ctx, p, state.read("denoised", Latents).tensor)
            lat = pipeline_class()._denormalize_latents(lat, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            state.write("latents", Latents(tensor=lat.detach().cpu(), modality="video"), ctx.node.name)
            alat = audio_latents(ctx, p, state.read("audio_denoised", Latents).tensor)
            state.write("audio_latents", Latents(tensor=alat.detach().cpu(), modality="audio"), ctx.node.name)


__all__ = ["AudioDecode", "ImageEncode", "Output", "TextEncode", "Validate", "VideoDecode", "audio_latents", "gemma_states",
           "video_latents"]
