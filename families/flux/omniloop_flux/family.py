"""The FLUX.1 family: detect, load, build pipelines, validate requests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Image, Latents, Tensors
from omniloop.capabilities import FamilyCapabilities, OffloadSupport
from omniloop.errors import CheckpointError, RequestError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop.rl import RolloutSupport
from omniloop_kit.options import dtype_option

from . import checkpoint as ck
from .defaults import TASKS, defaults_for, variant_of
from .denoise import Denoise, pack_latents, unpack_latents
from .lora import FLUX_ADAPTERS
from .policies import menu_for
from .resolve import FluxParams, TextParams, resolve
from .stages import ImageEncode, Output, TextEncode, VaeDecode, Validate, is_i2i, vae_scale_factor

#: deploy ``options`` this family reads (the runtime adds deploy, registry, attention)
KNOWN_OPTIONS = frozenset({"compile_backend", "compile_mode", "compile_dynamic", "vae_dtype"})


_dtype = dtype_option  # the family option's dtype (omniloop-kit)


class FluxFamily:
    """FLUX.1 [dev] / [schnell] text-to-image and image-to-image from diffusers-format checkpoints."""

    name = "flux"
    tasks = TASKS
    capabilities = FamilyCapabilities(
        block_interceptors=True,
        #: the denoise loop's step_batch changes no request state before its batched forward returns
        #: (the CFG plan's count is per step index): when that forward raises, each request's step
        #: is re-run alone, so only the request that causes it fails
        step_batch_retry_alone={"denoise"},
        #: post-training rollouts (omniloop.rl): the denoise loop's latents are packed 2x2 patches;
        #: trajectories hold them unpacked ``[C, H/8, W/8]``
        rollout_support=RolloutSupport(
            unpack=lambda x, loop: unpack_latents(x, *loop.extra["latent_hw"]), pack=lambda x, loop: pack_latents(x)),
        #: LoRA adapters (omniloop.adapters): the transformer's linears; ComfyUI/kohya keys converted
        adapters=FLUX_ADAPTERS,
        #: deploy offload: model | sequential (omniloop.offload) — the modules that move; under sequential
        #: the transformer streams its double- then single-stream blocks as one stack, the text encoders
        #: their layers (CLIP's moved from text_model.encoder to encoder in transformers 5); the VAE moves whole
        offload=OffloadSupport(components={
            "transformer": ("transformer_blocks", "single_transformer_blocks"),
            "text_encoder": "text_model.encoder.layers|encoder.layers", "text_encoder_2": "encoder.block", "vae": None,
        }),
        returns_latents=True,
        options=KNOWN_OPTIONS,
        resolve=True, task_defaults=True,
    )

    # -- detect / load ------------------------------------------------------------------------
    def detect(self, path: Path) -> bool:
        return ck.looks_like_flux(path)

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file and config first (one ``CheckpointError`` naming the file), then load
        each component by the class ``model_index.json`` names (local files only)."""
        vae_dtype = _dtype(options.get("vae_dtype", dtype), "vae_dtype")
        from .compile import compile_options

        compile_options(options)  # bad compile settings fail before loading
        root = ck.resolve_root(path)
        index = ck.check_checkpoint(root)
        extra_path = root / "omniloop.json"
        extra = ck.read_json(extra_path, "omniloop.json") if extra_path.exists() else {}
        comps: dict[str, Any] = {}
        for name in ck.REQUIRED:
            comps[name] = ck.load_component(
                index, root, name, device=device, dtype=vae_dtype if name == "vae" else dtype
            )
        model = self.from_components(
            comps, defaults=extra.get("defaults"), device=device, dtype=dtype, path=root,
            weight_version=ck.weight_version(root), options=options,
        )
        if extra.get("variant"):
            model.config["variant"] = extra["variant"]
        return model

    def from_components(
        self,
        components: dict[str, Any],
        *,
        defaults: dict[str, Any] | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        options: Mapping[str, Any] | None = None,
        path: Path | None = None,
        weight_version: str = "",
    ) -> LoadedModel:
        """A ``LoadedModel`` over modules already in memory (benchmarks, tests): ``transformer``,
        ``vae``, ``text_encoder``, ``text_encoder_2``, ``tokenizer``, ``tokenizer_2``, ``scheduler``.
        With deploy ``compile: true`` in ``options``, the transformer's blocks are compiled here."""
        missing = [n for n in ck.REQUIRED if n not in components]
        if missing:
            raise CheckpointError(f"from_components: missing component(s) {', '.join(missing)}")
        tf, vae = components["transformer"], components["vae"]
        vsf = vae_scale_factor(vae)
        sched = dict(components["scheduler"].config)
        config: dict[str, Any] = {
            "variant": variant_of(tf.config),
            "guidance_embeds": bool(tf.config.guidance_embeds),
            "dynamic_shifting": bool(sched.get("use_dynamic_shifting", False)),
            "tasks": TASKS,
            "vae_scale_factor": vsf,
            "size_multiple": vsf * 2,
            "defaults": defaults_for(vsf, defaults),
        }
        model = LoadedModel(
            family=self.name, path=path, components=components, config=config,
            device=device if device is not None else torch.device("cpu"), dtype=dtype,
            weight_version=weight_version or f"in-memory:{id(tf):x}",
        )
        from .compile import compile_blocks, compile_options

        copts = compile_options(options or {})
        if copts is not None:
            compile_blocks(tf, **copts)
            model.config["compile"] = copts
        menu_for(model, options)  # an incompatible scheduler config fails here, at load
        return model

    # -- pipelines ----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → [image_encode] → denoise → vae_decode → output."""
        from omniloop_policies import DenoiseParams

        if task not in TASKS:
            raise RequestError("task", f"the FLUX.1 family does not do {task.value!r} (it does: i2i, t2i)")
        menu = menu_for(model, options)
        nodes = [
            Node("validate", Validate(model, menu), writes={"params": Conditioning}),
            Node("text_encode", TextEncode(), reads={"params": Conditioning},
                 writes={"prompt_embeds": Embeddings, "negative_embeds": Embeddings},
                 params_schema=TextParams, uses=("text_encoder", "text_encoder_2")),
        ]
        reads: dict[str, type] = {"params": Conditioning, "prompt_embeds": Embeddings, "negative_embeds": Embeddings}
        if task is TaskType.I2I:
            nodes.append(Node("image_encode", ImageEncode(), reads={"params": Conditioning},
                              writes={"image_latents": Tensors}, when=is_i2i, uses=("vae",)))
            reads["image_latents"] = Tensors
        nodes += [
            Node("denoise", Denoise(menu), reads=reads, writes={"denoised": Latents},
                 optional_reads=frozenset({"image_latents", "negative_embeds"}), params_schema=DenoiseParams,
                 uses=("transformer",)),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("output", Output(), reads={"decoded": Tensors, "denoised": Latents},
                 writes={"image": Image, "latents": Latents}),
        ]
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

    # -- requests -----------------------------------------------------------------------------
    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *,
                node_params: Any = None) -> FluxParams:
        """The request resolved once (``Runtime.prepare`` calls this; the nodes read ``ctx.resolved``)."""
        params, _ = resolve(model, request, limits, menu=menu_for(model), node_params=node_params)
        return params

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        _, warnings = resolve(model, request, limits, menu=menu_for(model), decode_image=False)
        return warnings


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Variant, tasks and components of a checkpoint, from its configs only (no weights read)."""
    root = ck.resolve_root(path)
    index = ck.check_checkpoint(root)
    tf_cfg = ck.read_json(root / "transformer" / "config.json", "transformer config")
    return {
        "path": str(root), "variant": variant_of(tf_cfg), "tasks": sorted(t.value for t in TASKS),
        "components": {n: ck.class_of(index, n) for n in ck.REQUIRED},
    }
