"""The nodes of SD3's pipelines: ``validate`` → ``text_encode`` → [``image_encode``] → ``denoise``
→ ``vae_decode`` → ``output``.

Each stage does what diffusers' ``StableDiffusion3Pipeline`` / ``StableDiffusion3Img2ImgPipeline``
does at that point with the same tensor operations, so the results match diffusers bit for bit on
CPU in float32 (tests/sd3/test_parity.py). Components are shared by every request; what a request
owns (its scheduler instance, latents, generator) lives in ``RequestState`` / ``LoopState``.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop.request import TaskType
from omniloop_kit.stages import ImageFrames, return_latents
from omniloop_kit.stages import module_device as _module_device
from omniloop_kit.stages import params_of as kit_params_of

from .resolve import SD3Params, resolve


def params_of(state: RequestState) -> SD3Params:
    return kit_params_of(state)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------


class Validate:
    """The request's resolved parameters (policies, decoded input image) onto the ``params`` edge."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        resolved = getattr(ctx, "resolved", None)
        if isinstance(resolved, SD3Params):  # Runtime.prepare resolved it once (SD3Family.resolve)
            params, warnings = resolved, list(resolved.warnings)
        else:  # driven outside a runtime
            limits = getattr(ctx.options.get("deploy"), "limits", None)
            params, warnings = resolve(self.model, state.request, limits)
        if warnings:
            known = state.metrics.setdefault("warnings", [])
            known.extend(w for w in warnings if w not in known)
        state.write("params", Conditioning(values={"params": params}), ctx.node.name)


# --------------------------------------------------------------------------------------------
# text_encode
# --------------------------------------------------------------------------------------------


def clip_states(tokenizer: Any, encoder: Any, text: str, max_length: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate hidden states ``[1, max_length, D]`` in ``dtype``, projected pooled ``[1, P]``)."""
    ids = tokenizer([text], padding="max_length", max_length=max_length, truncation=True, return_tensors="pt").input_ids
    out = encoder(ids.to(_module_device(encoder)), output_hidden_states=True)
    pooled = out[0]
    states = out.hidden_states[-2].to(dtype=dtype, device=device)
    return states, pooled


def t5_states(tokenizer: Any, encoder: Any, text: str, max_length: int, device: torch.device,
              dtype: torch.dtype, width: int) -> torch.Tensor:
    """T5 states ``[1, max_length, width]`` (zeros when the checkpoint has no T5, as diffusers)."""
    if encoder is None:
        return torch.zeros((1, max_length, width), device=device, dtype=dtype)
    ids = tokenizer([text], padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                    return_tensors="pt").input_ids
    states = encoder(ids.to(_module_device(encoder)))[0]
    return states.to(dtype=encoder.dtype, device=device)


def encode_prompt(components: dict[str, Any], text: str, max_sequence_length: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint context ``[1, 77 + max_sequence_length, joint_dim]`` and pooled ``[1, P]`` of ``text``."""
    te1, te2, te3 = components["text_encoder"], components["text_encoder_2"], components.get("text_encoder_3")
    tok1 = components["tokenizer"]
    clip_len = int(tok1.model_max_length)
    dtype = te1.dtype  # diffusers casts both CLIP states to the first encoder's dtype
    s1, p1 = clip_states(tok1, te1, text, clip_len, device, dtype)
    s2, p2 = clip_states(components["tokenizer_2"], te2, text, clip_len, device, dtype)
    clip = torch.cat([s1, s2], dim=-1)
    width = int(components["transformer"].config.joint_attention_dim)
    t5 = t5_states(components.get("tokenizer_3"), te3, text, max_sequence_length, device, dtype, width)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat([p1, p2], dim=-1)


class TextEncode:
    """Prompt and negative prompt → ``prompt_embeds`` / ``negative_embeds`` (pooled in ``extra``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = params_of(state)
        with torch.no_grad():
            pos, pos_pooled = encode_prompt(ctx.components, p.prompt, p.max_sequence_length, ctx.device)
            neg, neg_pooled = encode_prompt(ctx.components, p.negative_prompt, p.max_sequence_length, ctx.device)
        state.write("prompt_embeds", Embeddings(tensor=pos, extra={"pooled": pos_pooled}), ctx.node.name)
        state.write("negative_embeds", Embeddings(tensor=neg, extra={"pooled": neg_pooled}), ctx.node.name)


# --------------------------------------------------------------------------------------------
# image_encode (i2i)
# --------------------------------------------------------------------------------------------


class ImageEncode:
    """The input image → ``image_latents``: resized/normalised as diffusers' ``VaeImageProcessor``
    does, VAE-encoded with a sample drawn from the request's generator, shifted and scaled."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        from diffusers.image_processor import VaeImageProcessor

        from omniloop.media import to_pil

        p = params_of(state)
        assert p.image is not None
        vae = ctx.components["vae"]
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype
        proc = VaeImageProcessor(vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
                                 vae_latent_channels=vae.config.latent_channels)
        pixels = proc.preprocess(to_pil(p.image), height=p.height, width=p.width)
        with torch.no_grad():
            pixels = pixels.to(device=ctx.device, dtype=dtype)
            latents = vae.encode(pixels).latent_dist.sample(state.generator)
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        state.write("image_latents", Tensors(values={"latents": latents}), ctx.node.name)


# --------------------------------------------------------------------------------------------
# vae_decode / output
# --------------------------------------------------------------------------------------------


class VaeDecode:
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
            image = vae.decode(latents.to(_module_device(vae), vae.dtype), return_dict=False)[0]
        state.write("decoded", Tensors(values={"image": image}), ctx.node.name)


def to_uint8_image(image: torch.Tensor) -> torch.Tensor:
    """``[1, 3, H, W]`` in [-1, 1] → uint8 ``[H, W, 3]`` on the CPU: diffusers' ``postprocess``
    (denormalise in the decoder's dtype, then float32 ``* 255``, round half to even)."""
    unit = (image * 0.5 + 0.5).clamp(0, 1)
    unit = unit[0].permute(1, 2, 0).float()
    return (unit * 255).round().to(torch.uint8).contiguous().cpu()


class Output:
    """``image`` (uint8) and, when ``outputs.return_latents``, the final ``latents`` ``[1, C, H/8, W/8]``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        image = state.read("decoded", Tensors).values["image"]
        pixels = to_uint8_image(image)
        state.write("image", ImageFrames(pixels=pixels), ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("image", pixels, None)
        return_latents(ctx, state, "image")


def is_i2i(request: Any) -> bool:
    return request.task is TaskType.I2I


__all__ = [
    "ImageEncode",
    "ImageFrames",
    "Output",
    "TextEncode",
    "VaeDecode",
    "Validate",
    "encode_prompt",
    "is_i2i",
    "params_of",
    "to_uint8_image",
]
