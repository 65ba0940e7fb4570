"""The LTX-2 family: detect, load, build the ``t2v`` / ``i2v`` pipelines (video with a sound track), resolve requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Audio, Conditioning, Embeddings, Latents, Tensors, VideoFrames
from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import CheckpointError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS
from omniloop_kit.family import DiffusersFamily, load_checkpoint
from omniloop_kit.resolve import check_task

from . import checkpoint as ck
from .resolve import DEFAULTS, TASKS, DenoiseParams, LTX2Resolved, ltx2_config, resolve


class LTX2Family(DiffusersFamily):
    """LTX-2 joint audio-video generation from diffusers-format ``LTX2Pipeline`` checkpoints."""

    name = "ltx2"
    tasks = TASKS
    layout = ck.LAYOUT
    capabilities = FamilyCapabilities(
        #: its output holds audio (the sound track of t2v) and it reads request.audio's guidance knobs
        audio=True, audio_tasks=frozenset({"t2v", "i2v"}), audio_guidance=True,
        returns_latents=True, resolve=True, task_defaults=True,
        #: deploy compile: true compiles each transformer block (omniloop_kit.compile's settings)
        options=COMPILE_KEYS,
        # block_interceptors stays False: diffusers' transformer runs its own block loop (both
        # streams per block), so cache-dit / fbcache are refused at load with one line
    )

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file first (:func:`omniloop_ltx2.checkpoint.check_checkpoint`), then load each
        component. Deploy ``compile: true`` compiles each transformer block (regional compilation)."""
        from omniloop_kit.compile import compile_options

        compile_options(options)  # bad compile options fail before any weight is read
        got = load_checkpoint(path, lambda root: ck.check_checkpoint(root)[:2], ck.load_component, device=device,
                              dtype=dtype, names=list(ck.COMPONENTS))
        return self.from_components(got.components, path=got.root, device=device, dtype=dtype, options=options,
                                    defaults=got.extra.get("defaults"), weight_version=got.weight_version)

    needs = ck.COMPONENTS

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        unknown = sorted(set(defaults or {}) - set(DEFAULTS))
        if unknown:
            raise CheckpointError(f"omniloop.json: defaults.{unknown[0]} is not an ltx2 default (it takes: "
                                  f"{', '.join(DEFAULTS)})")
        config = ltx2_config(components)
        config.update(tasks=TASKS, defaults={**DEFAULTS, **(defaults or {})})
        return config, {}

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """The text is left-padded whatever the tokenizer's config says (diffusers sets it so on every
        call); with deploy ``compile: true`` each transformer block is wrapped in ``torch.compile``
        (lazy: the first forward of a shape compiles; :mod:`omniloop_kit.compile`)."""
        tok = model.components["tokenizer"]
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.compile_model(model, options, lambda tf: tf.transformer_blocks)

    # -- pipeline -----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode (→ image_encode for i2v) → denoise → video_decode + audio_decode → output."""
        from .denoise import Denoise
        from .stages import AudioDecode, ImageEncode, Output, TextEncode, Validate, VideoDecode

        check_task(task, TASKS, "the ltx2 family")
        params = {"params": Conditioning}
        return PipelineSpec(family=self.name, task=task, outputs={
            "video": "video", "audio": "audio", "latents": "latents", "audio_latents": "audio_latents"}, nodes=(
            Node("validate", Validate(model), writes=params),
            Node("text_encode", TextEncode(), reads=params, writes={"conditioning": Embeddings},
                 uses=("text_encoder", "connectors")),
            *((Node("image_encode", ImageEncode(), reads=params, writes={"image_latents": Tensors}, uses=("vae",)),)
              if task is TaskType.I2V else ()),
            Node("denoise", Denoise(), reads={**params, "conditioning": Embeddings,
                                              **({"image_latents": Tensors} if task is TaskType.I2V else {})},
                 writes={"denoised": Latents, "audio_denoised": Latents}, params_schema=DenoiseParams,
                 uses=("transformer",)),
            Node("video_decode", VideoDecode(), reads={**params, "conditioning": Embeddings, "denoised": Latents},
                 writes={"decoded_video": Tensors}, uses=("vae",)),
            Node("audio_decode", AudioDecode(), reads={**params, "audio_denoised": Latents},
                 writes={"decoded_audio": Tensors}, uses=("audio_vae", "vocoder")),
            Node("output", Output(), reads={**params, "decoded_video": Tensors, "decoded_audio": Tensors,
                                            "denoised": Latents, "audio_denoised": Latents},
                 writes={"video": VideoFrames, "audio": Audio, "latents": Latents, "audio_latents": Latents}),
        ))

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        d = model.config["defaults"]
        return {k: d[k] for k in ("steps", "guidance_scale", "height", "width", "frames", "fps", "negative_prompt")}

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, *, decode_image: bool = True,
                        node_params: Any = None) -> tuple[LTX2Resolved, list[str]]:
        params = node_params.get("denoise") if isinstance(node_params, dict) else node_params
        if params is None and request.node_params.get("denoise"):
            from omniloop.runtime import structure_params

            params = structure_params(DenoiseParams, request.node_params["denoise"], "node_params.denoise")
        got = resolve(model, request, params, decode_image=decode_image)
        return got, list(got.warnings)


__all__ = ["LTX2Family"]
