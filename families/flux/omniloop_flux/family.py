"""The FLUX.1 family: detect, load, build pipelines, validate requests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Embeddings
from omniloop.family import LoadedModel
from omniloop.graph import PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop.rl import RolloutSupport
from omniloop_kit.attention import fused_qkv_update_refusal, qkv_option
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS
from omniloop_kit.compile import compile_options
from omniloop_kit.family import CLIP_TEXT_LAYERS, T5_BLOCKS, DiffusersFamily, load_checkpoint
from omniloop_kit.family import capabilities as kit_capabilities
from omniloop_kit.ffn import ffn_option
from omniloop_kit.graphs import graph_option
from omniloop_kit.options import choice_option, dtype_option
from omniloop_kit.qk_norm_rope import qk_norm_rope_option
from omniloop_kit.resolve import check_task
from omniloop_kit.stages import image_nodes

from . import checkpoint as ck
from .blocks import MODULATION_MODES
from .defaults import TASKS, defaults_for, variant_of
from .denoise import Denoise, pack_latents, unpack_latents
from .lora import FLUX_ADAPTERS
from .policies import menu_for
from .resolve import FluxParams, TextParams, resolve
from .stages import TextEncode, Validate, vae_scale_factor
from .transformer import all_blocks

#: deploy ``options`` this family reads (the runtime adds deploy, registry, attention); cuda_graphs:
#: the outer forward replayed as one CUDA graph per input shape (omniloop_kit.graphs)
#: qkv: Q/K/V as three linears (diffusers' default) or diffusers' fused projections
#: (``fuse_qkv_projections``: one GEMM over [W_q; W_k; W_v], the originals kept); ffn_gelu: the double
#: blocks' feed-forward input projection and its tanh-GELU as one cuBLASLt matmul (``fused``, CUDA;
#: omniloop_kit.ffn) or diffusers' two kernels (``reference``); with ``fused`` the single blocks' MLP
#: too, through omniloop's block forwards (omniloop_flux.blocks); modulation: the blocks' AdaLN
#: modulations computed every step (``per-step``, diffusers) or once per request for all its steps
#: (``per-request``, omniloop_flux.blocks.modulation_table)
KNOWN_OPTIONS = frozenset({"vae_dtype", "cuda_graphs", "qkv", "ffn_gelu", "modulation", "qk_norm_rope", *COMPILE_KEYS})


def modulation_option(options: Mapping[str, Any]) -> str:
    """``options.modulation`` (:data:`omniloop_flux.blocks.MODULATION_MODES`), or one ``DeployError``."""
    return choice_option(options, "modulation", MODULATION_MODES)


def offload_refusal(mode: str, options: Mapping[str, Any]) -> str | None:
    """``capabilities.offload.refusal``: the per-request modulation table is computed from every block's
    norm linear at once, outside the block forwards that offload moves weights around."""
    if modulation_option(options) == "per-request":
        return ("options.modulation 'per-request' reads every block's modulation weights at a request's first "
                f"step, outside the block forwards that offload: {mode} streams; use modulation 'per-step'")
    return None


class FluxFamily(DiffusersFamily):
    """FLUX.1 [dev] / [schnell] text-to-image and image-to-image from diffusers-format checkpoints."""

    name = "flux"
    tasks = TASKS
    layout = ck.LAYOUT
    capabilities = kit_capabilities(
        #: post-training rollouts (omniloop.rl): the denoise loop's latents are packed 2x2 patches;
        #: trajectories hold them unpacked ``[C, H/8, W/8]``
        rollout_support=RolloutSupport(
            unpack=lambda x, loop: unpack_latents(x, *loop.extra["latent_hw"]), pack=lambda x, loop: pack_latents(x)),
        #: LoRA adapters (omniloop-adapters): the transformer's linears; ComfyUI/kohya keys converted
        adapters=FLUX_ADAPTERS,
        #: deploy offload: model | sequential (omniloop-offload) — under sequential the transformer
        #: streams its double- then single-stream blocks as one stack, the text encoders their layers
        offload={"transformer": ("transformer_blocks", "single_transformer_blocks"),
                 "text_encoder": CLIP_TEXT_LAYERS, "text_encoder_2": T5_BLOCKS, "vae": None},
        offload_refusal=offload_refusal,
        options=KNOWN_OPTIONS,
        #: update_weights refused with options.qkv: fused (the fused copy would go stale)
        weight_update_refusal=fused_qkv_update_refusal,
        #: a real checkpoint's trained size from its configs (issue 42: warned, bounded by the deploy)
        checkpoint_limits=ck.limits,
    )

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file and config first (one ``CheckpointError`` naming the file), then load
        each component by the class ``model_index.json`` names (local files only)."""
        vae_dtype = dtype_option(options.get("vae_dtype", dtype), "vae_dtype")
        compile_options(options)  # bad compile settings fail before loading
        graph_option(options, device)
        qkv_option(options)
        ffn_option(options, device)
        modulation_option(options)
        qk_norm_rope_option(options, device)
        got = load_checkpoint(path, lambda root: (ck.check_checkpoint(root), list(ck.REQUIRED)), ck.load_component,
                              device=device, dtype=dtype, dtypes={"vae": vae_dtype})
        model = self.from_components(got.components, defaults=got.extra.get("defaults"), device=device, dtype=dtype,
                                     path=got.root, weight_version=got.weight_version, options=options)
        if got.extra.get("variant"):
            model.config["variant"] = got.extra["variant"]
        return model

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """FLUX.1's variant, tasks and request defaults from its transformer, VAE and scheduler."""
        tf, vsf = components["transformer"], vae_scale_factor(components["vae"])
        sched = dict(components["scheduler"].config)
        return {
            "variant": variant_of(tf.config),
            "guidance_embeds": bool(tf.config.guidance_embeds),
            "dynamic_shifting": bool(sched.get("use_dynamic_shifting", False)),
            "tasks": TASKS,
            "vae_scale_factor": vsf,
            "size_multiple": vsf * 2,
            "defaults": defaults_for(vsf, defaults),
        }, {}

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """``options.qkv: fused`` (diffusers' ``fuse_qkv_projections``), ``options.ffn_gelu: fused`` (the
        double blocks' feed-forwards, :mod:`omniloop_kit.ffn`; the single blocks' MLP) and ``options.modulation:
        per-request`` through omniloop's block forwards (:mod:`omniloop_flux.blocks`), the deploy's attention backend on
        every block's attention (:mod:`omniloop_flux.attention`; the core ``sdpa`` keeps diffusers'
        processors unless ``options.qk_norm_rope: fused`` asks for the kit's norm + rotary kernel,
        :mod:`omniloop_kit.qk_norm_rope`), ``options.cuda_graphs`` checked against the
        model's device; deploy ``compile: true``: the double- then single-stream blocks compiled;
        the menu built."""
        graph_option(options, model.device)
        qkv = qkv_option(options)
        if qkv == "fused":  # before the processors: diffusers' fusing sets its own
            model.components["transformer"].fuse_qkv_projections()
        model.config["qkv"] = qkv
        ffn_gelu = ffn_option(options, model.device)
        modulation = modulation_option(options)
        if ffn_gelu == "fused" or modulation == "per-request":  # before compiling: the compiled blocks trace these
            from . import blocks

            blocks.install(model.components["transformer"], fused_mlp=ffn_gelu == "fused")
        if ffn_gelu == "fused":
            from omniloop_kit import ffn

            ffn.install(model.components["transformer"])
        model.config["ffn_gelu"] = ffn_gelu
        model.config["modulation"] = modulation
        qk_norm_rope = qk_norm_rope_option(options, model.device)
        backend = options.get("attention")
        name = getattr(backend, "name", "sdpa")
        if name != "sdpa" or qk_norm_rope == "fused":
            from .attention import install

            install(model.components["transformer"], backend if name != "sdpa" else None,
                    fused_norm_rope=qk_norm_rope == "fused")
        model.config["attention_backend"] = name
        model.config["qk_norm_rope"] = qk_norm_rope
        self.compile_model(model, options, all_blocks)
        menu_for(model, options)  # an incompatible scheduler config fails here, at load

    # -- pipelines ----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → [image_encode] → denoise → vae_decode → output (omniloop-kit's image nodes)."""
        from omniloop_policies import DenoiseParams

        check_task(task, TASKS, "the FLUX.1 family")
        menu = menu_for(model, options)
        nodes = image_nodes(
            Validate(model, menu), TextEncode(), Denoise(menu), i2i=task is TaskType.I2I,
            text_uses=("text_encoder", "text_encoder_2"), text_schema=TextParams, denoise_schema=DenoiseParams,
            denoise_reads={"prompt_embeds": Embeddings, "negative_embeds": Embeddings},
            optional=frozenset({"negative_embeds"}))
        return PipelineSpec(family=self.name, task=task, nodes=nodes, outputs={"image": "image", "latents": "latents"})

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        """What a request of ``task`` gets for fields it leaves unset (``Runtime.defaults``)."""
        d = model.config["defaults"]
        out = {k: d[k] for k in ("steps", "height", "width") if d.get(k) is not None}
        out["guidance_scale"] = d["i2i_guidance_scale"] if task is TaskType.I2I else d["guidance_scale"]
        out["frames"] = 1
        out["max_sequence_length"] = d["max_sequence_length"]
        if task is TaskType.I2I:
            out["strength"] = d["strength"]
        out.update(sampler="flow-euler", cfg="embedded")
        return out

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, **kw: Any) -> tuple[FluxParams, list[str]]:
        return resolve(model, request, limits, menu=menu_for(model), **kw)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Variant, tasks and components of a checkpoint, from its configs only (no weights read)."""
    root = ck.resolve_root(path)
    index = ck.check_checkpoint(root)
    tf_cfg = ck.read_json(root / "transformer" / "config.json", "transformer config")
    return {
        "path": str(root), "variant": variant_of(tf_cfg), "tasks": sorted(t.value for t in TASKS),
        "components": {n: ck.class_of(index, n) for n in ck.REQUIRED},
    }
