"""The nodes of Wan's pipelines.

``validate`` → ``text_encode`` → [``image_encode``] → ``denoise`` (a ``LoopStage``) → ``vae_decode``
→ ``output``. Each stage reproduces what diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline``
does at that point with the same tensor operations, so outputs match diffusers bit for bit on
CPU in float32 (see tests/wan/test_parity.py).

Components come from ``ctx.components`` (loaded once, shared by every request); everything a
request owns — its scheduler instance, latents, generator — lives in ``RequestState`` /
``LoopState``.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Embeddings, Latents, Tensors, VideoFrames
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop.request import TaskType
from omniloop_kit import stages as kit
from omniloop_kit.stages import module_device as _module_device
from omniloop_kit.stages import params_of, return_latents
from omniloop_kit.textcache import encode_texts

from .defaults import TEXT_LEN
from .denoise import Denoise
from .resolve import WanParams, resolve


def latent_stats(vae: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/std) as ``[1, z, 1, 1, 1]`` — diffusers' latent normalisation tensors."""
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(device, dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(device, dtype)
    return mean, inv_std


def denormalise(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents as the transformer sees them → as the VAE decodes them (the Wan pipelines' ops)."""
    mean, inv_std = latent_stats(vae, latents.device, latents.dtype)
    return latents / inv_std + mean


# --------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------


class Validate(kit.Validate):
    """Publish the request's resolved params (``ctx.resolved``, resolved once by ``Runtime.prepare``)
    on the ``params`` edge (omniloop-kit's node). Driven by hand outside a runtime, it resolves the
    request itself."""

    params_type = WanParams

    def resolve(self, request: Any, limits: Any) -> tuple[WanParams, list[str]]:
        return resolve(self.model, request, limits, menu=self.menu)


# --------------------------------------------------------------------------------------------
# text_encode
# --------------------------------------------------------------------------------------------


def encode_text(tokenizer: Any, text_encoder: Any, text: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """UMT5 states ``[1, 512, D]`` zeroed past the prompt's length, and the attention mask."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    inputs = tokenizer(
        [prompt_clean(text)], padding="max_length", max_length=TEXT_LEN, truncation=True,
        add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
    )
    ids, mask = inputs.input_ids, inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    te_device = _module_device(text_encoder)
    embeds = text_encoder(ids.to(te_device), mask.to(te_device)).last_hidden_state
    embeds = embeds.to(dtype=text_encoder.dtype, device=device)
    embeds = [u[:v] for u, v in zip(embeds, seq_lens, strict=True)]
    embeds = torch.stack([torch.cat([u, u.new_zeros(TEXT_LEN - u.size(0), u.size(1))]) for u in embeds], dim=0)
    return embeds.to(dtype), mask


class TextEncode:
    """Prompt and negative prompt → ``prompt_embeds`` / ``negative_embeds`` (transformer dtype).

    With a :class:`~omniloop_kit.textcache.TextEmbeddingCache` (default: one per loaded model)
    a text already encoded by this encoder and weights is not encoded again; the request's
    ``metrics["text_cache"]`` counts its hits and misses."""

    def __init__(self, cache: Any = None) -> None:
        self.cache = cache

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = params_of(state)
        tok, te = ctx.components["tokenizer"], ctx.components["text_encoder"]
        dtype = ctx.components["transformer"].dtype
        with torch.no_grad():
            out, metrics = encode_texts(self.cache, (p.prompt, p.negative_prompt), te, dtype, ctx.device,
                                        lambda text: encode_text(tok, te, text, ctx.device, dtype))
        (pos, pos_mask), (neg, neg_mask) = out
        if metrics is not None:
            state.metrics["text_cache"] = metrics
        state.write("prompt_embeds", Embeddings(tensor=pos, mask=pos_mask), ctx.node.name)
        state.write("negative_embeds", Embeddings(tensor=neg, mask=neg_mask), ctx.node.name)


# --------------------------------------------------------------------------------------------
# image_encode (i2v)
# --------------------------------------------------------------------------------------------


class ImageEncode:
    """The conditioning image → ``image_cond``: VAE latents of the first frame (+ mask) and, for
    Wan2.1 I2V checkpoints, the CLIP image states."""

    def __init__(self, expand_timesteps: bool) -> None:
        self.expand_timesteps = expand_timesteps

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        from diffusers.video_processor import VideoProcessor

        from omniloop_io.media import to_pil

        p = params_of(state)
        assert p.image is not None
        comps = ctx.components
        vae, tf = comps["vae"], comps["transformer"]
        pil = to_pil(p.image)
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if tf.config.image_dim is not None:  # Wan2.1 I2V: CLIP penultimate hidden states
                enc, proc = comps["image_encoder"], comps["image_processor"]
                pixel = proc(images=pil, return_tensors="pt").to(_module_device(enc))
                values["image_embeds"] = enc(**pixel, output_hidden_states=True).hidden_states[-2].to(ctx.device).to(tf.dtype)

            spatial = vae.config.scale_factor_spatial
            temporal = vae.config.scale_factor_temporal
            processor = VideoProcessor(vae_scale_factor=spatial)
            image = processor.preprocess(pil, height=p.height, width=p.width).to(ctx.device, dtype=torch.float32)
            image = image.unsqueeze(2)
            if self.expand_timesteps:
                video_condition = image
            else:
                zeros = image.new_zeros(image.shape[0], image.shape[1], p.frames - 1, p.height, p.width)
                video_condition = torch.cat([image, zeros], dim=2)
            video_condition = video_condition.to(device=_module_device(vae), dtype=vae.dtype)
            mean, inv_std = latent_stats(vae, ctx.device, torch.float32)
            latent = vae.encode(video_condition).latent_dist.mode()
            latent = latent.to(device=ctx.device, dtype=torch.float32)
            latent = (latent - mean) * inv_std

            lat_frames = (p.frames - 1) // temporal + 1
            lh, lw = p.height // spatial, p.width // spatial
            if self.expand_timesteps:
                mask = torch.ones(1, 1, lat_frames, lh, lw, dtype=torch.float32, device=ctx.device)
                mask[:, :, 0] = 0
                values["condition"] = latent
                values["first_frame_mask"] = mask
            else:
                mask = torch.ones(1, 1, p.frames, lh, lw)
                mask[:, :, list(range(1, p.frames))] = 0
                first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
                mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
                mask = mask.view(1, -1, temporal, lh, lw).transpose(1, 2).to(latent.device)
                values["condition"] = torch.concat([mask, latent], dim=1)
        state.write("image_cond", Tensors(values=values), ctx.node.name)


# --------------------------------------------------------------------------------------------
# vae_decode, output
# --------------------------------------------------------------------------------------------


class VaeDecode:
    """Latents → video in [-1, 1] ``[B, 3, T, H, W]`` (the ``decoded`` edge, float)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            latents = denormalise(vae, latents.to(_module_device(vae), dtype=vae.dtype))
            video = vae.decode(latents, return_dict=False)[0]
        state.write("decoded", Tensors(values={"video": video}), ctx.node.name)


def to_unit_frames(video: torch.Tensor) -> torch.Tensor:
    """``[B, 3, T, H, W]`` in [-1, 1] → float ``[T, H, W, 3]`` in [0, 1] (diffusers' ``np`` output)."""
    frames = video[0].permute(1, 0, 2, 3)  # [T, 3, H, W]
    frames = (frames * 0.5 + 0.5).clamp(0, 1)
    return frames.cpu().permute(0, 2, 3, 1).float()


def to_uint8(unit: torch.Tensor) -> torch.Tensor:
    return (unit * 255).round().to(torch.uint8)


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """``[B, 3, T, H, W]`` in [-1, 1] → uint8 ``[T, H, W, 3]`` on the CPU.

    The same values as ``to_uint8(to_unit_frames(video))`` (each op is exact IEEE arithmetic on
    any device), but converted where the video is, so a quarter of the bytes cross to the CPU.
    """
    frames = (video[0] * 0.5 + 0.5).clamp(0, 1)
    frames = (frames * 255).round().to(torch.uint8)  # [3, T, H, W]
    return frames.permute(1, 2, 3, 0).contiguous().cpu()


class Output:
    """Writes the request's artifacts: ``video`` (uint8 frames) and, on request, ``latents``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = params_of(state)
        video = state.read("decoded", Tensors).values["video"]
        frames = to_uint8_frames(video)
        art = VideoFrames(frames=frames, fps=p.fps)
        state.write("video", art, ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("video", frames, None)
        return_latents(ctx, state, "video")


def is_i2v(request: Any) -> bool:
    return request.task is TaskType.I2V


__all__ = [
    "Denoise",
    "ImageEncode",
    "Output",
    "TextEncode",
    "VaeDecode",
    "Validate",
    "encode_text",
    "is_i2v",
    "to_uint8",
    "to_unit_frames",
]
