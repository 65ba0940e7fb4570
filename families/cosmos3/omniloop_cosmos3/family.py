"""The Cosmos 3 omni family: detect, load, build the ``t2v`` pipeline, resolve requests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Action, Audio, Conditioning, Latents, Tensors, VideoFrames
from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import DeployError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS
from omniloop_kit.compile import compile_options
from omniloop_kit.family import DiffusersFamily, load_checkpoint
from omniloop_kit.resolve import check_task

from . import checkpoint as ck
from .denoise import Denoise
from .resolve import DEFAULTS, TASKS, Cosmos3Resolved, resolve, wants_sound
from .stages import ImageEncode, Output, SoundDecode, VaeDecode, Validate

#: deploy options read: the text-KV pool's size in tokens (both CFG branches of every running request),
#: and the compile settings of omniloop_kit.compile (deploy ``compile: true``: the gen pathway's layer compiled)
OPTIONS = frozenset({"text_kv_tokens", *COMPILE_KEYS})
DEFAULT_TEXT_KV_TOKENS = 8192
#: the pipeline's own settings (``model_index.json``) the family reads
PIPELINE_FLAGS = ("use_native_flow_schedule", "default_use_system_prompt", "enable_safety_checker")


class Cosmos3Family(DiffusersFamily):
    """Cosmos 3 omni (mixture-of-transformers over packed text + vision sequences)."""

    name = "cosmos3"
    tasks = TASKS
    layout = ck.LAYOUT
    #: no block interceptors, offload, adapters or rollouts (yet): the pathways run their own layer loop;
    #: sound for t2v/i2v (``audio.enabled``), action-conditioned i2v
    capabilities = FamilyCapabilities(returns_latents=True, resolve=True, task_defaults=True, options=OPTIONS,
                                      #: a t2v or i2v request with ``audio: {"enabled": true}`` gets a sound track
                                      audio=True, audio_tasks=frozenset({"t2v", "i2v"}),
                                      #: action-conditioned i2v (``action: {...}``) and ``artifacts["action"]``
                                      actions=True)

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file first (one ``CheckpointError`` naming it), then load each component by
        the class ``model_index.json`` names (local files only; never the safety checker)."""
        _kv_tokens(options)
        compile_options(options)  # bad compile settings fail before loading
        got = load_checkpoint(path, ck.check_checkpoint, ck.load_component, device=device, dtype=dtype)
        flags = {k: got.index[k] for k in PIPELINE_FLAGS if k in got.index}
        model = self.from_components(got.components, defaults=got.extra.get("defaults"), device=device, dtype=dtype,
                                     path=got.root, weight_version=got.weight_version, options=options,
                                     pipeline=flags)
        model.config["variant"] = got.extra.get("variant", "cosmos3")
        return model

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        tf, vae = components["transformer"].config, components["vae"].config
        flags = dict(extra.get("pipeline") or {})
        if flags.get("default_use_system_prompt", True) is not True:
            raise DeployError("model_index.json: default_use_system_prompt false is not supported by this family")
        unknown = sorted(set(defaults or {}) - set(DEFAULTS) - {"num_frames"})
        if unknown:
            raise DeployError(f"omniloop.json: defaults.{unknown[0]} is not a cosmos3 default (it takes: "
                              f"{', '.join(DEFAULTS)})")
        return {
            "variant": "in-memory", "tasks": TASKS, "defaults": {**DEFAULTS, **(defaults or {})},
            "latent_channels": int(tf.latent_channel), "vae_scale_spatial": int(vae.scale_factor_spatial),
            "vae_scale_temporal": int(vae.scale_factor_temporal),
            "native_flow_schedule": bool(flags.get("use_native_flow_schedule", False)),
            "sound": _sound(components),
            "action": {"dim": int(tf.action_dim), "domains": int(tf.num_embodiment_domains)} if tf.action_gen else None,
            "safety_checker": False,
        }, {}

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """The text-KV pool (``omniloop_kvcache.CacheManager``, KV class ``cosmos3-text``): every
        layer's und K/V of the running requests' prompts, ``text_kv_tokens`` tokens in all."""
        from omniloop_kvcache import CacheManager, KVLayout

        tf = model.components["transformer"]
        c = tf.config
        layout = KVLayout(layers=int(c.num_hidden_layers), kv_heads=int(c.num_key_value_heads),
                          head_dim=int(c.head_dim), dtype=tf.dtype, device=next(tf.parameters()).device)
        block = 16
        tokens = _kv_tokens(options)
        model.components["text_kv"] = CacheManager(layout, block_size=block, num_blocks=-(-tokens // block),
                                                   name="cosmos3-text")
        model.config["text_kv"] = {"tokens": tokens, "block_size": block, "bytes_per_token": layout.bytes_per_token}
        settings = compile_options(options)
        if settings is not None:  # one torch.compile of the gen pathway's layer body, shared by every layer
            model.config["compile"] = dict(settings)

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → denoise → vae_decode → output."""
        check_task(task, TASKS, "the cosmos3 family")
        settings = model.config.get("compile")
        layer_fn = None
        if settings is not None:
            from .transformer import gen_layer

            layer_fn = torch.compile(gen_layer, **settings)
        denoise = Denoise(model.config, model.components["text_kv"], layer_fn)
        outputs = {"video": "video", "latents": "latents", "audio": "audio", "sound_latents": "sound_latents",
                   "action": "action"}
        return PipelineSpec(family=self.name, task=task, outputs=outputs, nodes=(
            Node("validate", Validate(model), writes={"params": Conditioning}),
            Node("image_encode", ImageEncode(), reads={"params": Conditioning}, writes={"image_latents": Latents},
                 uses=("vae",), when=lambda r: r.task in (TaskType.I2V, TaskType.V2V)),
            Node("denoise", denoise, reads={"params": Conditioning, "image_latents": Latents},
                 optional_reads=frozenset({"image_latents"}), writes={"denoised": Latents, "denoised_sound": Latents}, uses=("transformer", "text_kv")),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("sound_decode", SoundDecode(), reads={"denoised_sound": Latents}, writes={"waveform": Tensors},
                 uses=("sound_tokenizer",), when=wants_sound),
            Node("output", Output(), reads={"params": Conditioning, "decoded": Tensors, "denoised": Latents,
                                            "denoised_sound": Latents, "denoised_action": Latents,
                                            "waveform": Tensors},
                 optional_reads=frozenset({"denoised_sound", "denoised_action", "waveform"}),
                 writes={"video": VideoFrames, "latents": Latents, "audio": Audio, "sound_latents": Latents,
                         "action": Action}),
        ))

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        d = model.config["defaults"]
        return {"steps": d["steps"], "guidance_scale": d["guidance_scale"], "frames": d["num_frames"],
                "height": d["height"], "width": d["width"], "fps": d["fps"]}

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, **kw: Any
                        ) -> tuple[Cosmos3Resolved, list[str]]:
        p = resolve(model, request, decode_image=kw.get("decode_image", True))
        return p, list(p.warnings)


def _sound(components: dict[str, Any]) -> dict[str, Any] | None:
    """The sound stream's sizes (latent width, sample rate, decoder hop), None without one."""
    st, tf = components.get("sound_tokenizer"), components["transformer"].config
    if st is None or not tf.sound_gen:
        return None
    c = st.config
    hop = int(c.hop_size) if c.hop_size is not None else math.prod(c.dec_strides)
    return {"dim": int(tf.sound_dim), "sampling_rate": int(c.sampling_rate), "hop": hop}


def _kv_tokens(options: dict[str, Any]) -> int:
    v = options.get("text_kv_tokens", DEFAULT_TEXT_KV_TOKENS)
    if isinstance(v, bool) or not isinstance(v, int) or v < 16:
        raise DeployError(f"options.text_kv_tokens: a whole number of tokens >= 16, got {v!r}")
    return v


__all__ = ["OPTIONS", "Cosmos3Family"]
