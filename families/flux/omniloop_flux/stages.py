"""The nodes of FLUX.1's pipelines.

``validate`` → ``text_encode`` → [``image_encode``] → ``denoise`` (a ``LoopStage``, see
:mod:`omniloop_flux.denoise`) → ``vae_decode`` → ``output``. Each stage does what diffusers'
``FluxPipeline`` / ``FluxImg2ImgPipeline`` does at that point with the same tensor operations, so
outputs match diffusers bit for bit on CPU in float32 (tests/flux/test_parity.py).

Components come from ``ctx.components`` (loaded once, shared by every request); everything a
request owns — its scheduler instance, latents, generator — lives in ``RequestState`` / ``LoopState``.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop.request import TaskType
from omniloop_kit.stages import ImageFrames, module_device, return_latents, vae_scale_factor
from omniloop_kit.stages import params_of as kit_params_of

from .resolve import FluxParams, resolve


def params_of(state: RequestState) -> FluxParams:
    return kit_params_of(state)  # type: ignore[no-any-return]


class Validate:
    """Resolve defaults and policies, check the request again (cheap), into the ``params`` edge."""

    def __init__(self, model: Any, menu: Any = None) -> None:
        self.model = model
        self.menu = menu

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        params = ctx.resolved  # resolved once by Runtime.prepare (FluxFamily.resolve)
        if not isinstance(params, FluxParams):  # driven by hand, outside a runtime
            limits = getattr(ctx.options.get("deploy"), "limits", None)
            params, warnings = resolve(self.model, state.request, limits, menu=self.menu)
            if warnings:
                known = state.metrics.setdefault("warnings", [])
                known.extend(w for w in warnings if w not in known)
        state.write("params", Conditioning(values={"params": params}), ctx.node.name)


# --------------------------------------------------------------------------------------------
# text_encode
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# image_encode (i2i)
# --------------------------------------------------------------------------------------------


class ImageEncode:
    """The input image → its VAE latents ``[1, C, H/8, W/8]`` (``image_latents``), normalised with the
    VAE's shift and scaling factors. Samples the latent distribution with the request's generator
    *before* the denoise node draws its noise — diffusers' order."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        from diffusers.image_processor import VaeImageProcessor

        from omniloop.media import to_pil

        p = params_of(state)
        assert p.image is not None
        vae = ctx.components["vae"]
        dtype = ctx.components["text_encoder_2"].dtype  # diffusers: prompt_embeds.dtype
        processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae) * 2)
        with torch.no_grad():
            image = processor.preprocess(to_pil(p.image), height=p.height, width=p.width).to(dtype=torch.float32)
            image = image.to(device=ctx.device, dtype=dtype)
            # a VAE in its own dtype (deploy option vae_dtype) gets its input in that dtype
            dist = vae.encode(image.to(module_device(vae), dtype=vae.dtype)).latent_dist
            latents = dist.sample(state.generator)
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        state.write("image_latents", Tensors(values={"latents": latents.to(ctx.device, dtype=dtype)}), ctx.node.name)


# --------------------------------------------------------------------------------------------
# vae_decode, output
# --------------------------------------------------------------------------------------------


class VaeDecode:
    """Unpacked latents → image in [-1, 1] ``[B, 3, H, W]`` (the ``decoded`` edge)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
            latents = latents.to(module_device(vae), dtype=vae.dtype)
            image = vae.decode(latents, return_dict=False)[0]
        state.write("decoded", Tensors(values={"image": image}), ctx.node.name)


def to_uint8_frames(image: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in [-1, 1] → uint8 ``[B, H, W, 3]`` on the CPU: diffusers' postprocess
    (``(x / 2 + 0.5).clamp(0, 1)``, then ``(x * 255).round()``), the same IEEE ops on any device."""
    x = (image * 0.5 + 0.5).clamp(0, 1)
    x = (x.float() * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu()


class Output:
    """Writes the request's artifacts: ``image`` (:class:`ImageFrames`: uint8 ``pixels [H, W, 3]``,
    ``frames [1, H, W, 3]``) and, on request, ``latents`` (unpacked ``[1, C, H/8, W/8]``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        frames = to_uint8_frames(state.read("decoded", Tensors).values["image"])
        state.write("image", ImageFrames(pixels=frames[0]), ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("image", frames, None)
        return_latents(ctx, state, "image")


def is_i2i(request: Any) -> bool:
    return request.task is TaskType.I2I
