"""The Wan family: detect, load, build pipelines, validate requests."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Latents, Tensors, VideoFrames
from omniloop.capabilities import ParallelSupport, Rollout
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kit.attention import fused_qkv_update_refusal
from omniloop_kit.checkpoint import read_extra
from omniloop_kit.family import CLIP_VISION_LAYERS, T5_BLOCKS, DiffusersFamily, compute_device
from omniloop_kit.family import capabilities as kit_capabilities
from omniloop_kit.options import dtype_option
from omniloop_kit.resolve import check_task

from . import checkpoint as ck
from .causal.pipeline import build_causal_pipeline, causal_options, rollout_mode
from .defaults import defaults_for, model_kind, tasks_of
from .lora import WAN_ADAPTERS
from .options import KNOWN as WAN_OPTIONS
from .options import WanOptions, parse_options
from .policies import menu_for
from .resolve import WanParams, resolve
from .stages import Denoise, ImageEncode, Output, TextEncode, VaeDecode, Validate, is_i2v


def offload_refusal(mode: str, options: Mapping[str, Any]) -> str | None:
    """Why ``offload: mode`` cannot run with these family options (omniloop.placement.check_offload)."""
    if mode == "sequential" and options.get("rollout") == "causal":
        return ("cannot stream the blocks of options.rollout: causal (its chunk forward calls each block's "
                "layers directly, so no block hook runs); use offload: model")
    return None


def attention_grid_refusal(deploy: Any, options: Mapping[str, Any]) -> str | None:
    """Why a backend taking the token grid (``accepts_grid``: ``sparse-tile``) would not get it
    (omniloop.placement.check_attention_grid): the bidirectional forward passes it
    (``attention.set_token_grid``); Ulysses' all-to-all wrapper and the causal rollout's chunk
    attention do not, so their self-attention would run dense."""
    sp = deploy.parallel.sp
    if sp > 1:
        return (f"parallel.sp={sp} (Ulysses) passes none: it would compute dense attention; "
                "use parallel.sp: 1 or another backend")
    if rollout_mode(options) == "causal":
        return ("options.rollout: causal (chunk attention) passes none: it would compute dense attention; "
                "use the bidirectional rollout or another backend")
    return None


def attention_heads(path: Path) -> int | None:
    """The transformer's attention heads from its config (``parallel.sp`` must divide them)."""
    from .parallel import attention_heads

    return attention_heads(path)


log = logging.getLogger("omniloop.wan")


def _report_unfused_fronts(model: LoadedModel) -> None:
    """``options.norm_quant: fused`` with GEMMs that are not FP8 (the deploy's linear_precision_options.keep, or
    layers FP8 left as too small): those blocks compute the unfused order. Said once per loaded model, after the
    linear precision was applied (the runtime applies it after the family's load; it records its report in
    ``model.config["linear_precision"]``), in ``model.config["norm_quant_unfused"]``."""
    cfg = model.config
    if cfg.get("norm_quant") != "fused" or "norm_quant_unfused" in cfg or not cfg.get("linear_precision"):
        return  # (no precision applied yet: a bench that builds first and converts after)
    from . import blocks

    unfused: dict[str, int] = {}
    for name in ("transformer", "transformer_2"):
        tf = model.components.get(name)
        for path, n in (blocks.unfused_blocks(tf) if tf is not None else {}).items():
            unfused[f"{name}.{path}"] = unfused.get(f"{name}.{path}", 0) + n
    cfg["norm_quant_unfused"] = unfused
    if unfused:
        log.warning("options.norm_quant: fused does not apply where a GEMM it feeds is not FP8 (e.g. kept by "
                    "linear_precision_options.keep); those blocks compute the unfused order: %s",
                    ", ".join(f"{p} x{n}" for p, n in unfused.items()))


class WanFamily(DiffusersFamily):
    """Wan2.1 / Wan2.2 text-to-video and image-to-video from diffusers-format checkpoints."""

    name = "wan"
    tasks = frozenset({TaskType.T2V, TaskType.I2V})
    layout = ck.LAYOUT
    needs = ("transformer", "vae")  # what from_components reads (the stages ask for the rest)
    capabilities = kit_capabilities(
        #: LoRA adapters (omniloop.adapters): the transformer's linears; ComfyUI/kohya keys converted
        adapters=WAN_ADAPTERS,
        #: deploy offload: model | sequential (omniloop.offload) — the modules that move, and the block
        #: list each streams one block at a time under ``sequential`` (the VAE moves whole)
        offload={"transformer": "blocks", "transformer_2": "blocks", "text_encoder": T5_BLOCKS,
                 "image_encoder": CLIP_VISION_LAYERS, "vae": None},
        offload_refusal=offload_refusal,
        #: deploy parallel: {sp, cfg} — Ulysses sequence parallel and CFG-parallel (omniloop_wan.parallel);
        #: cfg: one rank per guidance branch (cond, uncond); block interceptors bound to the sp group
        #: (omniloop_wan.parallel.bind_block_interceptor)
        parallel=ParallelSupport(axes={"sp", "cfg"}, limits={"cfg": 2}, attention_heads=attention_heads,
                                 block_interceptors=True),
        attention_grid=attention_grid_refusal,
        #: update_weights refused with options.qkv: fused (the fused copy would go stale)
        weight_update_refusal=fused_qkv_update_refusal,
        #: deploy placement (role pools, omniloop-parallel): components whose stages may run in a worker
        role_components={"text_encoder", "image_encoder", "vae"},
        #: options.rollout: bidirectional (the ordinary pipeline) or causal (chunk streaming, issue 21)
        rollouts=(Rollout("bidirectional", returns_latents=True, description="the whole clip at once"),
                  Rollout("causal", streams=True, description="chunk by chunk, KV-cached (omniloop_wan.causal); "
                          "its output is the decoded video only")),
        #: deploy options read (omniloop_wan.options.KNOWN)
        options=WAN_OPTIONS,
        supported_tasks=True,
        #: a real checkpoint's trained size from its configs (issue 42: warned, bounded by the deploy)
        checkpoint_limits=ck.limits,
    )

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Load every component once (local files only). Bad files → ``CheckpointError`` naming them.

        Options: see :mod:`omniloop_wan.options` (checked before any weight is read).
        """
        opts = parse_options(options)
        check_fused_options(opts, compute_device(options, device))
        vae_dtype = dtype_option(options.get("vae_dtype", "float32"), "vae_dtype")
        root = ck.resolve_root(path)
        index = ck.check_checkpoint(root)
        extra = read_extra(root)
        comps = ck.load(root, index, device=device, dtype=dtype, vae_dtype=vae_dtype)
        model = self.from_components(
            comps, index=index, defaults=extra.get("defaults"), device=device, dtype=dtype, path=root,
            weight_version=ck.weight_version(root, ck.LAYOUT.components_in(index)), options=options,
        )
        model.config["variant"] = extra.get("variant", model.config["kind"])
        return model

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     index: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint's kind, tasks, scales and request defaults; ``index``: the
        ``model_index.json`` values that matter (``boundary_ratio``, ``expand_timesteps``)."""
        index = dict(index or {})
        tf, vae = components["transformer"], components["vae"]
        kind = model_kind(index, dict(tf.config), dict(vae.config))
        return {
            "kind": kind,
            "variant": kind,
            "tasks": tasks_of(kind),
            "boundary_ratio": index.get("boundary_ratio"),
            "expand_timesteps": bool(index.get("expand_timesteps", False)),
            "vae_scale_temporal": int(vae.config.scale_factor_temporal),
            "vae_scale_spatial": int(vae.config.scale_factor_spatial),
            "size_multiple": int(vae.config.scale_factor_spatial) * int(tf.config.patch_size[1]),
            "defaults": defaults_for(kind, defaults),
            "image_encoder": "image_encoder" in components,
            "model_index": index,
        }, {}

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """The attention backend's processors, fused kernels, compiled blocks, VAE tiling/slicing and
        the text cache (:func:`configure`); the causal rollout's options and the menu checked."""
        configure(model, parse_options(options), device=compute_device(options, model.device))
        if rollout_mode(options) == "causal":
            causal_options(options)  # bad rollout_options are refused at load, not at the first request
        # the denoise policies this checkpoint offers; an incompatible scheduler config fails here
        menu_for(model, options)

    # -- pipelines ----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → [image_encode] → denoise → vae_decode → output."""
        from omniloop_policies import DenoiseParams

        cfg = model.config
        menu = menu_for(model, options)
        check_task(task, cfg["tasks"], f"this {cfg['kind']} checkpoint")
        _report_unfused_fronts(model)
        if rollout_mode(options) == "causal":  # options.rollout: causal — chunk streaming (issue 21)
            return build_causal_pipeline(model, task, options, menu)
        image = task is TaskType.I2V
        nodes = [
            Node("validate", Validate(model, menu), writes={"params": Conditioning}),
            Node("text_encode", TextEncode(cfg.get("text_cache")), reads={"params": Conditioning},
                 writes={"prompt_embeds": Embeddings, "negative_embeds": Embeddings}, uses=("text_encoder",)),
        ]
        denoise_reads: dict[str, type] = {
            "params": Conditioning, "prompt_embeds": Embeddings, "negative_embeds": Embeddings,
        }
        if image:
            uses = ("vae", "image_encoder") if cfg["image_encoder"] else ("vae",)
            nodes.append(Node("image_encode", ImageEncode(cfg["expand_timesteps"]), reads={"params": Conditioning},
                              writes={"image_cond": Tensors}, when=is_i2v, uses=uses))
            denoise_reads["image_cond"] = Tensors
        experts = ("transformer", "transformer_2") if cfg["boundary_ratio"] is not None else ("transformer",)
        nodes += [
            Node("denoise", _denoise(cfg, menu, options), reads=denoise_reads, writes={"denoised": Latents},
                 optional_reads=frozenset({"image_cond"}), params_schema=DenoiseParams, uses=experts),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("output", Output(), reads={"params": Conditioning, "decoded": Tensors, "denoised": Latents},
                 writes={"video": VideoFrames, "latents": Latents}),
        ]
        return PipelineSpec(family=self.name, task=task, nodes=nodes, outputs={"video": "video", "latents": "latents"})

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        """What a request of ``task`` gets for fields it leaves unset (``Runtime.defaults``)."""
        d = model.config["defaults"]
        keys = ("steps", "guidance_scale", "guidance_scale_2", "height", "width", "frames", "fps", "negative_prompt")
        out = {k: d[k] for k in keys if d.get(k) is not None}
        menu = model.config.get("policy_menu")
        if menu is not None:
            out.update(sampler=menu.default_sampler, cfg=menu.default_cfg)
        return out

    def supported_tasks(self, model: LoadedModel) -> frozenset[TaskType]:
        """The tasks of this checkpoint's kind (a T2V checkpoint does not do I2V): what
        ``Runtime.supported_tasks`` reports and front ends advertise."""
        return frozenset(model.config["tasks"])

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, **kw: Any) -> tuple[WanParams, list[str]]:
        return resolve(model, request, limits, menu=menu_for(model), **kw)


def _denoise(cfg: dict[str, Any], menu: Any, options: dict[str, Any]) -> Denoise:
    """The denoise loop; under deploy ``parallel: {sp, cfg}`` the rank-aware one (omniloop_wan.parallel)."""
    par = getattr(options.get("deploy"), "parallel", None)
    if par is not None and par.world_size > 1:
        from .parallel import ParallelDenoise

        return ParallelDenoise(cfg, menu, sp=par.sp, cfg=par.cfg)
    return Denoise(cfg, menu)


def check_fused_options(opts: WanOptions, device: Any) -> None:
    """The CUDA-only fused kernels, refused before loading where they cannot run."""
    from omniloop.errors import DeployError

    from .fused import unavailable_reason

    for key, needs_triton in (("qk_norm_rope", True), ("ffn_gelu", False), ("norm_quant", True)):
        if getattr(opts, key) != "fused":
            continue
        why = unavailable_reason(device)
        if why and (needs_triton or "triton" not in why):
            raise DeployError(f"options.{key}: 'fused' cannot run here: {why}")


def configure(model: LoadedModel, opts: WanOptions, device: Any = None) -> None:
    """Set up the loaded modules for a deployment: fused Q/K/V, attention processors, compiled blocks, VAE
    tiling/slicing/CPU kernels, the text-embedding cache (``model.config["text_cache"]``).
    ``device``: where the model computes (default: ``model.device``)."""
    from omniloop_kit.textcache import TextEmbeddingCache

    from .attention import install
    from .compile import compile_blocks

    check_fused_options(opts, model.device if device is None else device)
    comps = model.components
    experts = [comps[n] for n in ("transformer", "transformer_2") if n in comps]
    if opts.qkv == "fused":  # diffusers' fused projections; the processors read attn.fused_projections
        from .attention import fuse_projections

        for tf in experts:
            fuse_projections(tf)
    model.config["qkv"] = opts.qkv
    if opts.attention is not None:
        for tf in experts:
            install(tf, opts.attention, qk_norm_rope=opts.qk_norm_rope)
        model.config["attention_backend"] = opts.attention.name
    model.config["qk_norm_rope"] = opts.qk_norm_rope
    if opts.ffn_gelu == "fused":
        from . import ffn

        for tf in experts:
            ffn.install(tf)
    model.config["ffn_gelu"] = opts.ffn_gelu
    if opts.norm_quant == "fused":  # before compiling: the compiled blocks are these
        from . import blocks

        for tf in experts:
            blocks.install(tf)
    model.config["norm_quant"] = opts.norm_quant
    if opts.compile is not None:
        for tf in experts:
            compile_blocks(tf, **opts.compile)
        model.config["compile"] = dict(opts.compile)
    vae = comps["vae"]
    if opts.vae_tiling is not None:
        vae.enable_tiling(**opts.vae_tiling)
    if opts.vae_slicing:
        vae.enable_slicing()
    if opts.vae_cpu_kernels == "fast":
        from .vae_kernels import install_fast_kernels

        install_fast_kernels(vae)
    model.config["vae_cpu_kernels"] = opts.vae_cpu_kernels
    model.config["text_cache"] = (
        TextEmbeddingCache(opts.text_cache, weight_version=model.weight_version) if opts.text_cache else None
    )


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Kind, tasks and components of a checkpoint, from its configs only (no weights read)."""
    root = ck.resolve_root(path)
    index = ck.check_checkpoint(root)
    tf_cfg = ck.read_json(root / "transformer" / "config.json", "transformer config")
    vae_cfg = ck.read_json(root / "vae" / "config.json", "vae config")
    kind = model_kind(index, tf_cfg, vae_cfg)
    return {
        "path": str(root),
        "kind": kind,
        "tasks": sorted(t.value for t in tasks_of(kind)),
        "components": ck.LAYOUT.components_in(index),
        "boundary_ratio": index.get("boundary_ratio"),
        "model_index": json.loads((root / "model_index.json").read_text()),
    }
