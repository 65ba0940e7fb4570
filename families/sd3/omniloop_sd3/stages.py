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

from omniloop.artifacts import Embeddings
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop_kit import stages as kit
from omniloop_kit.stages import ImageEncode, ImageFrames, VaeDecode, params_of
from omniloop_kit.stages import ImageOutput as Output
from omniloop_kit.stages import is_image_to_image as is_i2i
from omniloop_kit.stages import module_device as _module_device

from .resolve import SD3Params, resolve


def to_uint8_image(image: torch.Tensor) -> torch.Tensor:
    """``[1, 3, H, W]`` in [-1, 1] → uint8 ``[H, W, 3]`` on the CPU (diffusers' ``postprocess``)."""
    return kit.to_uint8_frames(image)[0]


class Validate(kit.Validate):
    """The request's resolved parameters (policies, decoded input image) onto the ``params`` edge."""

    params_type = SD3Params

    def resolve(self, request: Any, limits: Any) -> tuple[SD3Params, list[str]]:
        return resolve(self.model, request, limits)


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
