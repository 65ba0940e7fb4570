"""The nodes of FLUX.1's pipelines.

``validate`` → ``text_encode`` → [``image_encode``] → ``denoise`` (a ``LoopStage``, see
:mod:`omniloop_flux.denoise`) → ``vae_decode`` → ``output``. Each stage does what diffusers'
``FluxPipeline`` / ``FluxImg2ImgPipeline`` does at that point with the same tensor operations, so
outputs match diffusers bit for bit on CPU in float32 (tests/flux/test_parity.py). FLUX's own are
the validate node's resolve and the text encoding; image encoding, decoding and the output are
omniloop-kit's (:mod:`omniloop_kit.stages`).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Embeddings
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop_kit import stages as kit
from omniloop_kit.stages import ImageFrames, ImageOutput, VaeDecode, module_device, params_of, vae_scale_factor
from omniloop_kit.stages import is_image_to_image as is_i2i
from omniloop_kit.stages import to_uint8_frames as to_uint8_frames

from .resolve import FluxParams, resolve

Output = ImageOutput  # the names this module had
ImageEncode = kit.ImageEncode


class Validate(kit.Validate):
    """Resolve defaults and policies once (``FluxFamily.resolve``), into the ``params`` edge."""

    params_type = FluxParams

    def resolve(self, request: Any, limits: Any) -> tuple[FluxParams, list[str]]:
        return resolve(self.model, request, limits, menu=self.menu)


def encode_prompt(
    comps: dict[str, Any], prompt: str, max_sequence_length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T5 states ``[1, L, D]``, CLIP pooled ``[1, D']``, text ids ``[L, 3]``) — diffusers' ``encode_prompt``."""
    tok, te = comps["tokenizer"], comps["text_encoder"]
    tok2, te2 = comps["tokenizer_2"], comps["text_encoder_2"]
    clip_ids = tok(
        [prompt], padding="max_length", max_length=tok.model_max_length, truncation=True,
        return_overflowing_tokens=False, return_length=False, return_tensors="pt",
    ).input_ids
    pooled = te(clip_ids.to(module_device(te)), output_hidden_states=False).pooler_output
    pooled = pooled.to(dtype=te.dtype, device=device)
    t5_ids = tok2(
        [prompt], padding="max_length", max_length=max_sequence_length, truncation=True,
        return_length=False, return_overflowing_tokens=False, return_tensors="pt",
    ).input_ids
    embeds = te2(t5_ids.to(module_device(te2)), output_hidden_states=False)[0]
    embeds = embeds.to(dtype=te2.dtype, device=device)
    text_ids = torch.zeros(embeds.shape[1], 3).to(device=device, dtype=te.dtype)
    return embeds, pooled, text_ids


class TextEncode:
    """Prompt → ``prompt_embeds``: T5 states (``tensor``), CLIP's pooled output and the text
    position ids (``extra["pooled"]``, ``extra["text_ids"]``); with true CFG (CFG ``classic``) the
    negative prompt the same way → ``negative_embeds``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = params_of(state)
        texts = [("prompt_embeds", p.prompt)]
        if p.negative_prompt is not None:
            texts.append(("negative_embeds", p.negative_prompt))
        for edge, text in texts:
            with torch.no_grad():
                embeds, pooled, text_ids = encode_prompt(ctx.components, text, p.max_sequence_length, ctx.device)
            state.write(edge, Embeddings(tensor=embeds, extra={"pooled": pooled, "text_ids": text_ids}), ctx.node.name)


__all__ = ["ImageEncode", "ImageFrames", "Output", "TextEncode", "VaeDecode", "Validate", "encode_prompt", "is_i2i",
           "params_of", "to_uint8_frames", "vae_scale_factor"]
