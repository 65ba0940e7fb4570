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
from attrs import define, field

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors, VideoFrames
from omniloop.interceptors import call_model
from omniloop.loop import LoopState, RequestState, StageContext, StepContext, StepResult
from omniloop.request import TaskType

from . import sampling
from .defaults import TEXT_LEN
from .resolve import WanParams, resolve
from .transformer import wan_forward


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' ``randn_tensor``: drawn on the generator's device, then moved."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def _params(state: RequestState) -> WanParams:
    return state.read("params", Conditioning).values["params"]


def _vae_stats(vae: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/std) as ``[1, z, 1, 1, 1]`` — diffusers' latent normalisation tensors."""
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(device, dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(device, dtype)
    return mean, inv_std


def _module_device(module: Any) -> torch.device:
    try:
        return next(module.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------


class Validate:
    """Resolve defaults and check the request again (cheap) into the ``params`` edge."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        limits = getattr(ctx.options.get("deploy"), "limits", None)
        params, warnings = resolve(self.model, state.request, limits)
        if warnings:
            known = state.metrics.setdefault("warnings", [])
            known.extend(w for w in warnings if w not in known)
        state.write("params", Conditioning(values={"params": params}), ctx.node.name)


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
    """Prompt and negative prompt → ``prompt_embeds`` / ``negative_embeds`` (transformer dtype)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = _params(state)
        tok, te = ctx.components["tokenizer"], ctx.components["text_encoder"]
        dtype = ctx.components["transformer"].dtype
        with torch.no_grad():
            pos, pos_mask = encode_text(tok, te, p.prompt, ctx.device, dtype)
            neg, neg_mask = encode_text(tok, te, p.negative_prompt, ctx.device, dtype)
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

        from omniloop.media import to_pil

        p = _params(state)
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
            mean, inv_std = _vae_stats(vae, ctx.device, torch.float32)
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
# denoise
# --------------------------------------------------------------------------------------------


@define(frozen=True)
class DenoiseParams:
    """Per-request knobs of the denoise node (``node_params.denoise``)."""

    #: Wan2.2 A14B: guidance of the low-noise expert (``transformer_2``); default: the model's
    #: default, else ``diffusion.guidance_scale``
    guidance_scale_2: float | None = field(default=None, metadata={"ge": 0.0})


class Denoise:
    """One solver step per ``step()``: route to an expert, run each guidance branch, combine, step."""

    def __init__(self, model_config: dict[str, Any]) -> None:
        self.boundary_ratio = model_config.get("boundary_ratio")
        self.expand_timesteps = bool(model_config.get("expand_timesteps"))
        self.default_guidance_2 = model_config["defaults"].get("guidance_scale_2")

    # -- init ---------------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = _params(state)
        comps = ctx.components
        tf, vae = comps["transformer"], comps["vae"]
        scheduler = sampling.make_scheduler(comps["scheduler"], p.shift)
        timesteps = sampling.set_timesteps(scheduler, p.steps, ctx.device)

        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        channels = vae.config.z_dim
        shape = (1, channels, (p.frames - 1) // temporal + 1, p.height // spatial, p.width // spatial)
        generator = state.generator
        if generator is None:  # driven without a runtime: still deterministic per request
            generator = torch.Generator("cpu").manual_seed(int(state.request.diffusion.seed or 0))
        latents = _randn(shape, generator, ctx.device, torch.float32)

        guidance_2 = None
        if self.boundary_ratio is not None:
            guidance_2 = ctx.params.guidance_scale_2 if ctx.params is not None else None
            if guidance_2 is None:
                guidance_2 = p.guidance_scale if state.request.diffusion.guidance_scale is not None else (
                    self.default_guidance_2 if self.default_guidance_2 is not None else p.guidance_scale
                )
        boundary = None
        if self.boundary_ratio is not None:
            boundary = self.boundary_ratio * scheduler.config.num_train_timesteps

        loop = LoopState(total=len(timesteps), branches=sampling.cfg_branches(p.guidance_scale))
        loop.tensors["latents"] = latents
        loop.extra.update(
            scheduler=scheduler, timesteps=timesteps, generator=generator, guidance_scale=p.guidance_scale,
            guidance_scale_2=guidance_2, boundary_timestep=boundary, transformer_dtype=tf.dtype,
            experts_used=[],
        )
        return loop

    # -- one step -----------------------------------------------------------------------------
    def _model_input(self, state: RequestState, loop: LoopState, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(latent model input, timestep, image embeds) for this step, as diffusers builds them."""
        latents = loop.tensors["latents"]
        dtype = loop.extra["transformer_dtype"]
        cond = state.get("image_cond")
        values = cond.values if isinstance(cond, Tensors) else {}
        image_embeds = values.get("image_embeds")
        if self.expand_timesteps:
            if "first_frame_mask" in values:  # TI2V image-to-video: the first latent frame is the image
                mask = values["first_frame_mask"]
                x = ((1 - mask) * values["condition"] + mask * latents).to(dtype)
            else:
                mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
                x = latents.to(dtype)
            ts = (mask[0][0][:, ::2, ::2] * t).flatten()
            timestep = ts.unsqueeze(0).expand(latents.shape[0], -1)
        elif "condition" in values:
            x = torch.cat([latents, values["condition"]], dim=1).to(dtype)
            timestep = t.expand(latents.shape[0])
        else:
            x = latents.to(dtype)
            timestep = t.expand(latents.shape[0])
        return x, timestep, image_embeds

    def _predict(
        self, ctx: StageContext, state: RequestState, loop: LoopState, step: StepContext, expert: str,
        x: torch.Tensor, timestep: torch.Tensor, image_embeds: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        model = ctx.components[expert]
        preds: dict[str, torch.Tensor] = {}
        for branch in loop.branches:
            sc = step.with_branch(branch)
            text = state.read("prompt_embeds" if branch == "cond" else "negative_embeds", Embeddings).tensor
            bctx = ctx.block_context(sc, loop, prefix=f"{expert}.blocks")
            inputs = {"hidden_states": x, "timestep": timestep, "encoder_hidden_states": text,
                      "encoder_hidden_states_image": image_embeds}

            def compute(text: torch.Tensor = text, bctx: Any = bctx) -> torch.Tensor:
                return wan_forward(model, x, timestep, text, image_embeds, bctx)

            preds[branch] = call_model(ctx.step_interceptors, sc, loop, inputs, compute)
            if ctx.taps_enabled:
                ctx.tap("noise_pred", preds[branch], sc)
        return preds

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        i = loop.step
        t = loop.extra["timesteps"][i]
        expert = sampling.route_expert(t, loop.extra["boundary_timestep"])
        if expert == "transformer_2":
            guidance = loop.extra["guidance_scale_2"]
        else:
            guidance = loop.extra["guidance_scale"]
        used = loop.extra["experts_used"]
        if not used or used[-1] != expert:
            used.append(expert)
        step = StepContext(
            state.request.request_id, ctx.node.name, i, loop.total, float(t),
            expert=expert if self.boundary_ratio is not None else None,
        )
        with torch.no_grad():
            x, timestep, image_embeds = self._model_input(state, loop, t)
            preds = self._predict(ctx, state, loop, step, expert, x, timestep, image_embeds)
            guided = sampling.classic_cfg(preds, guidance)
            if ctx.taps_enabled:
                ctx.tap("guided", guided, step)
            latents = sampling.sampler_step(loop.extra["scheduler"], guided, t, loop.tensors["latents"])
        loop.tensors["latents"] = latents
        if ctx.taps_enabled:
            ctx.tap("latents", latents, step)
        return StepResult(done=i + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        latents = loop.tensors["latents"]
        cond = state.get("image_cond")
        if self.expand_timesteps and isinstance(cond, Tensors) and "first_frame_mask" in cond.values:
            mask = cond.values["first_frame_mask"]
            latents = (1 - mask) * cond.values["condition"] + mask * latents
        state.metrics["experts"] = list(loop.extra.get("experts_used", []))
        state.write("denoised", Latents(tensor=latents, modality="video"), ctx.node.name)
        # the scheduler instance and the generator go with the loop state
        loop.extra.pop("scheduler", None)


# --------------------------------------------------------------------------------------------
# vae_decode, output
# --------------------------------------------------------------------------------------------


class VaeDecode:
    """Latents → video in [-1, 1] ``[B, 3, T, H, W]`` (the ``decoded`` edge, float)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.components["vae"]
        latents = state.read("denoised", Latents).tensor
        with torch.no_grad():
            latents = latents.to(_module_device(vae), dtype=vae.dtype)
            mean, inv_std = _vae_stats(vae, latents.device, latents.dtype)
            latents = latents / inv_std + mean
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
        p = _params(state)
        video = state.read("decoded", Tensors).values["video"]
        frames = to_uint8_frames(video)
        art = VideoFrames(frames=frames, fps=p.fps)
        state.write("video", art, ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("video", frames, None)
        if state.request.outputs.return_latents:
            lat = state.read("denoised", Latents)
            state.write("latents", Latents(tensor=lat.tensor.detach().cpu(), modality="video"), ctx.node.name)


def is_i2v(request: Any) -> bool:
    return request.task is TaskType.I2V


__all__ = [
    "Denoise",
    "DenoiseParams",
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
