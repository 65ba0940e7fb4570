"""The SD3 family: detect, load, build pipelines, validate requests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Embeddings
from omniloop.family import LoadedModel
from omniloop.graph import PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kit.attention import fused_qkv_update_refusal, qkv_option
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS
from omniloop_kit.compile import compile_options
from omniloop_kit.family import CLIP_TEXT_LAYERS, T5_BLOCKS, DiffusersFamily, load_checkpoint
from omniloop_kit.family import capabilities as kit_capabilities
from omniloop_kit.ffn import ffn_option
from omniloop_kit.graphs import graph_option
from omniloop_kit.resolve import check_task
from omniloop_kit.stages import image_nodes

from . import checkpoint as ck
from .defaults import defaults_for
from .lora import SD3_ADAPTERS
from .policies import menu_for
from .resolve import SD3DenoiseParams, SD3Params, TextParams, resolve
from .stages import TextEncode, Validate
from .transformer import joint_steps

TASKS = frozenset({TaskType.T2I, TaskType.I2I})


class SD3Family(DiffusersFamily):
    """Stable Diffusion 3 / 3.5 text-to-image and image-to-image from diffusers-format checkpoints."""

    name = "sd3"
    tasks = TASKS
    layout = ck.LAYOUT
    capabilities = kit_capabilities(
        #: LoRA adapters (omniloop-adapters): the transformer's linears, diffusers' files
        adapters=SD3_ADAPTERS,
        #: deploy offload: model | sequential (omniloop-offload) — under sequential the transformer
        #: and the three text encoders stream their blocks; the VAE moves whole
        offload={"transformer": "transformer_blocks", "text_encoder": CLIP_TEXT_LAYERS,
                 "text_encoder_2": CLIP_TEXT_LAYERS, "text_encoder_3": T5_BLOCKS, "vae": None},
        #: deploy options read: options.qkv, ffn_gelu (omniloop_kit.ffn: the feed-forwards' input
        #: projection and tanh GELU as one cuBLASLt matmul, CUDA only), the compile settings
        #: (check_options) and cuda_graphs (omniloop_kit.graphs: the outer forward replayed as one CUDA
        #: graph per input shape)
        options={"qkv", "ffn_gelu", "cuda_graphs", *COMPILE_KEYS},
        #: update_weights refused with options.qkv: fused (the fused copy would go stale)
        weight_update_refusal=fused_qkv_update_refusal,
        #: a real checkpoint's trained size from its configs (issue 42: warned, bounded by the deploy)
        checkpoint_limits=ck.limits,
    )

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file (configs, headers, the components' fit) first, then load each
        component by the class ``model_index.json`` names (local files only).

        Options: ``qkv`` (``separate`` | ``fused``, :mod:`omniloop_sd3.attention`), ``ffn_gelu``
        (``reference`` | ``fused``, :mod:`omniloop_kit.ffn`; CUDA only), ``compile_backend``,
        ``compile_mode``, ``compile_dynamic``, ``cuda_graphs`` (:mod:`omniloop_kit.graphs`); the deploy's
        ``attention_backend`` and ``compile`` are honoured."""
        check_options(options, device)  # bad options fail before any weight is read
        got = load_checkpoint(path, lambda root: (idx := ck.check_checkpoint(root), ck.LAYOUT.components_in(idx)),
                              lambda *a, **k: ck.load_model(*a, **k), device=device, dtype=dtype)
        return self.from_components(
            got.components, defaults=got.extra.get("defaults"), device=device, dtype=dtype, path=got.root,
            options=options, weight_version=got.weight_version, variant=got.extra.get("variant"),
        )

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     variant: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """SD3's variant, sizes and per-task request defaults from its transformer and VAE."""
        tf, vae = components["transformer"], components["vae"]
        vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        patch = int(tf.config.patch_size)
        task_defaults = defaults_for(int(tf.config.sample_size), vae_scale, defaults)
        has_dual = bool(tf.config.get("dual_attention_layers"))
        return {
            "variant": variant or ("sd3.5-medium" if has_dual else "sd3.5" if tf.config.get("qk_norm") else "sd3"),
            "tasks": TASKS,
            "size_multiple": vae_scale * patch,
            "max_size": int(tf.config.pos_embed_max_size or 96) * patch * vae_scale,
            "task_defaults": task_defaults,
            "options": options,
        }, {"defaults": dict(task_defaults)}

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """``options.qkv`` and the deploy's attention backend installed on the transformer,
        ``options.ffn_gelu: fused`` swapped into its feed-forwards (before compiling: the compiled steps
        trace it), its joint steps compiled (deploy ``compile: true``), a menu per task built;
        ``options.cuda_graphs`` checked against the model's device (the denoise node replays its forward
        as a CUDA graph)."""
        check_options(options, model.device)
        tf, qkv, backend = model.components["transformer"], qkv_option(options), options.get("attention")
        if qkv == "fused" or getattr(backend, "name", "sdpa") != "sdpa":
            from .attention import install

            install(tf, backend, fused_qkv=qkv == "fused")
            model.config["attention_backend"] = getattr(backend, "name", "sdpa")
        model.config["qkv"] = qkv
        ffn_gelu = ffn_option(options, model.device)
        if ffn_gelu == "fused":
            from omniloop_kit import ffn

            ffn.install(tf)
        model.config["ffn_gelu"] = ffn_gelu
        self.compile_model(model, options, joint_steps)
        for task in TASKS:  # an incompatible scheduler config or policies option fails at load
            menu_for(model, task, options)

    # -- pipelines ----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → [image_encode] → denoise → vae_decode → output (omniloop-kit's image nodes)."""
        from .denoise import Denoise

        check_task(task, TASKS, "the sd3 family")
        nodes = image_nodes(
            Validate(model), TextEncode(), Denoise(menu_for(model, task)), i2i=task is TaskType.I2I,
            text_uses=("text_encoder", "text_encoder_2", "text_encoder_3"), text_schema=TextParams,
            denoise_schema=SD3DenoiseParams, denoise_reads={"prompt_embeds": Embeddings, "negative_embeds": Embeddings})
        return PipelineSpec(family=self.name, task=task, nodes=nodes, outputs={"image": "image", "latents": "latents"})

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        return dict(model.config["task_defaults"][TaskType(task)])

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, **kw: Any) -> tuple[SD3Params, list[str]]:
        return resolve(model, request, limits, **kw)


def check_options(options: Mapping[str, Any], device: Any = None) -> None:
    """The family options (``qkv``, ``ffn_gelu`` and ``cuda_graphs`` on ``device``, ``compile_*``), checked
    before loading."""
    qkv_option(options)
    ffn_option(options, device if device is not None else "cpu")
    compile_options(options)
    graph_option(options, device)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Components and transformer architecture of a checkpoint, from its configs only."""
    root = ck.resolve_root(path)
    index = ck.check_checkpoint(root)
    tf = ck.read_json(root / "transformer" / "config.json", "transformer config")
    return {"path": str(root), "components": ck.LAYOUT.components_in(index), "qk_norm": tf.get("qk_norm"),
            "dual_attention_layers": list(tf.get("dual_attention_layers") or []), "model_index": index}


__all__ = ["SD3Family", "check_options", "describe_checkpoint"]
