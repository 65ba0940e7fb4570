"""Stage helpers the diffusers-format families share: the ``validate`` node, the image artifact,
where a module's weights are, the VAE's scale, the resolved params on the ``params`` edge, an image
family's ``image_encode`` / ``vae_decode`` / ``output`` nodes (an ``AutoencoderKL`` with
``shift_factor`` and ``scaling_factor``, diffusers' pre- and post-processing op for op), and the
output stage's latents return (``outputs.return_latents``)."""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from omniloop.artifacts import Conditioning, Embeddings, Image, Latents, Tensors
from omniloop.context import StageContext
from omniloop.loop import RequestState
from omniloop.request import TaskType


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


class Validate:
    """Publish the request's resolved params (``ctx.resolved``, resolved once by ``Runtime.prepare``
    through the family's ``resolve``) on the ``params`` edge, its warnings in the request's metrics.
    Driven by hand outside a runtime, it resolves the request itself (:meth:`resolve`, the family's)."""

    #: the family's resolved form (what ``ctx.resolved`` holds when a runtime resolved the request)
    params_type: type = object

    def __init__(self, model: Any, menu: Any = None, resolve: Any = None, params_type: type | None = None) -> None:
        self.model = model
        self.menu = menu
        self._resolve = resolve  # ``resolve(request, limits)``: the family's, instead of a subclass's
        if params_type is not None:
            self.params_type = params_type

    def resolve(self, request: Any, limits: Any) -> tuple[Any, list[str]]:
        if self._resolve is None:
            raise NotImplementedError
        return self._resolve(request, limits)  # type: ignore[no-any-return]

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        params = ctx.resolved
        if isinstance(params, self.params_type) and self.params_type is not object:
            warnings = list(params.warnings)
        else:  # driven outside a runtime
            params, warnings = self.resolve(state.request, getattr(ctx.options.get("deploy"), "limits", None))
        if warnings:
            known = state.metrics.setdefault("warnings", [])
            known.extend(w for w in warnings if w not in known)
        state.write("params", Conditioning(values={"params": params}), ctx.node.name)


def is_image_to_image(request: Any) -> bool:
    return request.task is TaskType.I2I


def encode_image(vae: Any, image: torch.Tensor, height: int, width: int, generator: Any, device: torch.device,
                 dtype: torch.dtype, *, scale_factor: int | None = None) -> torch.Tensor:
    """An input image (uint8 ``[H, W, 3]``) → its normalised VAE latents, as diffusers' img2img
    pipelines do: ``VaeImageProcessor.preprocess`` at ``height`` x ``width``, the encoder in its own
    device and dtype, a sample drawn with the request's ``generator`` (before the noise), then
    ``(latents - shift_factor) * scaling_factor``, in ``dtype`` on ``device``."""
    from diffusers.image_processor import VaeImageProcessor

    from omniloop_io.media import to_pil

    proc = VaeImageProcessor(vae_scale_factor=scale_factor or vae_scale_factor(vae),
                             vae_latent_channels=vae.config.latent_channels)
    with torch.no_grad():
        pixels = proc.preprocess(to_pil(image), height=height, width=width).to(device=device, dtype=dtype)
        latents = vae.encode(pixels.to(module_device(vae), dtype=vae.dtype)).latent_dist.sample(generator)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    return latents.to(device, dtype=dtype)


class VaeDecode:
    """Latents → image in [-1, 1] ``[B, 3, H, W]`` (the ``decoded`` edge): un-normalised with the
    VAE's scaling and shift factors, decoded in the VAE's device and dtype."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
            image = vae.decode(latents.to(module_device(vae), dtype=vae.dtype), return_dict=False)[0]
        state.write("decoded", Tensors(values={"image": image}), ctx.node.name)


def to_uint8_frames(image: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in [-1, 1] → uint8 ``[B, H, W, 3]`` on the CPU: diffusers' postprocess
    (``(x / 2 + 0.5).clamp(0, 1)``, then float32 ``(x * 255).round()``), the same IEEE ops on any device."""
    x = (image * 0.5 + 0.5).clamp(0, 1)
    x = (x.float() * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu()


class ImageOutput:
    """Writes the request's artifacts: ``image`` (:class:`ImageFrames`: uint8 ``pixels [H, W, 3]``,
    ``frames [1, H, W, 3]``, tapped as ``image``) and, on request, ``latents``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        frames = to_uint8_frames(state.read("decoded", Tensors).values["image"])
        state.write("image", ImageFrames(pixels=frames[0]), ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("image", frames, None)
        return_latents(ctx, state, "image")


def image_nodes(validate: Any, encode: Any, denoise: Any, *, i2i: bool, text_uses: tuple[str, ...],
                denoise_reads: dict[str, type], text_schema: Any = None, denoise_schema: Any = None,
                optional: frozenset[str] = frozenset()) -> list[Any]:
    """The nodes of an image family's pipeline: ``validate`` → ``text_encode`` (``encode``) →
    [``image_encode``, i2i] → ``denoise`` → ``vae_decode`` → ``output``."""
    from omniloop.graph import Node

    text = {"prompt_embeds": Embeddings, "negative_embeds": Embeddings}
    reads: dict[str, type] = {"params": Conditioning, **denoise_reads}
    nodes = [Node("validate", validate, writes={"params": Conditioning}),
             Node("text_encode", encode, reads={"params": Conditioning}, writes=text, params_schema=text_schema,
                  uses=text_uses)]
    if i2i:
        nodes.append(Node("image_encode", ImageEncode(), reads={"params": Conditioning, "prompt_embeds": Embeddings},
                          writes={"image_latents": Tensors}, when=is_image_to_image, uses=("vae",)))
        reads["image_latents"] = Tensors
    return [*nodes,
            Node("denoise", denoise, reads=reads, writes={"denoised": Latents},
                 optional_reads=frozenset({"image_latents", *optional}), params_schema=denoise_schema,
                 uses=("transformer",)),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("output", ImageOutput(), reads={"decoded": Tensors, "denoised": Latents},
                 writes={"image": Image, "latents": Latents})]


class ImageEncode:
    """The input image → ``image_latents`` (:func:`encode_image`), in the dtype of the text states
    (``prompt_embeds``: diffusers' ``prompt_embeds.dtype``)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = params_of(state)
        dtype = state.read("prompt_embeds", Embeddings).tensor.dtype
        latents = encode_image(ctx.components["vae"], p.image, p.height, p.width, state.generator, ctx.device, dtype)
        state.write("image_latents", Tensors(values={"latents": latents}), ctx.node.name)


__all__ = [
    "ImageEncode",
    "ImageFrames",
    "ImageOutput",
    "VaeDecode",
    "Validate",
    "encode_image",
    "image_nodes",
    "is_image_to_image",
    "module_device",
    "params_of",
    "return_latents",
    "to_uint8_frames",
    "vae_scale_factor",
]
