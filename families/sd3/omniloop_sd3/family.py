"""The SD3 family: detect, load, build pipelines, validate requests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Conditioning, Embeddings, Image, Latents, Tensors
from omniloop.capabilities import FamilyCapabilities, OffloadSupport
from omniloop.errors import CheckpointError, DeployError, RequestError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop.rl import RolloutSupport

from . import checkpoint as ck
from .defaults import defaults_for
from .lora import SD3_ADAPTERS
from .policies import menu_for
from .resolve import SD3DenoiseParams, SD3Params, TextParams, resolve
from .stages import ImageEncode, Output, TextEncode, VaeDecode, Validate, is_i2i

TASKS = frozenset({TaskType.T2I, TaskType.I2I})


class SD3Family:
    """Stable Diffusion 3 / 3.5 text-to-image and image-to-image from diffusers-format checkpoints."""

    name = "sd3"
    tasks = TASKS
    capabilities = FamilyCapabilities(
        block_interceptors=True,
        #: the denoise loop's step_batch changes no request state before its batched forward returns
        #: (the CFG plan's count is per step index): when that forward raises, each request's step
        #: is re-run alone, so only the request that causes it fails
        step_batch_retry_alone={"denoise"},
        #: post-training rollouts (omniloop.rl): the denoise loop runs them; its latents are unpacked already
        rollout_support=RolloutSupport(),
        #: LoRA adapters (omniloop.adapters): the transformer's linears, diffusers' files
        adapters=SD3_ADAPTERS,
        #: deploy offload: model | sequential (omniloop.offload) — the modules that move; under sequential
        #: the transformer and the three text encoders stream their blocks (CLIP's layers moved from
        #: text_model.encoder to encoder in transformers 5 for some classes); the VAE moves whole
        offload=OffloadSupport(components={
            "transformer": "transformer_blocks", "text_encoder": "text_model.encoder.layers|encoder.layers",
            "text_encoder_2": "text_model.encoder.layers|encoder.layers", "text_encoder_3": "encoder.block",
            "vae": None,
        }),
        returns_latents=True,
        #: deploy options read: options.qkv and the compile settings (check_options)
        options={"qkv", "compile_backend", "compile_mode", "compile_dynamic"},
        resolve=True, task_defaults=True,
    )

    # -- detect / load ------------------------------------------------------------------------
    def detect(self, path: Path) -> bool:
        return ck.looks_like_sd3(path)

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file (configs, headers, the components' fit) first, then load each
        component by the class ``model_index.json`` names (local files only).

        Options: ``qkv`` (``separate`` | ``fused``, :mod:`omniloop_sd3.attention`), ``compile_backend``,
        ``compile_mode``, ``compile_dynamic`` (:mod:`omniloop_sd3.compile`); the deploy's
        ``attention_backend`` and ``compile`` are honoured."""
        check_options(options)  # bad options fail before any weight is read
        root = ck.resolve_root(path)
        index = ck.check_checkpoint(root)
        index_path = root / "model_index.json"
        present = ck.components_in(index)
        classes = {name: ck.component_class(index, name, index_path) for name in present}
        extra_path = root / "omniloop.json"
        extra = ck.read_json(extra_path, "omniloop.json") if extra_path.exists() else {}
        comps: dict[str, Any] = {}
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            if name in present:
                comps[name] = ck.load_model(classes[name], root / name, device=device, dtype=dtype)
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
            if name in present:
                comps[name] = ck.load_tokenizer(classes[name], root / name)
        comps["scheduler"] = ck.load_scheduler(classes["scheduler"], root / "scheduler")
        return self.from_components(
            comps, defaults=extra.get("defaults"), device=device, dtype=dtype, path=root, options=options,
            weight_version=ck.weight_version(root, present), variant=extra.get("variant"),
        )

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
        variant: str | None = None,
    ) -> LoadedModel:
        """A ``LoadedModel`` over modules already in memory (benchmarks, tests, notebooks).

        ``components``: ``transformer``, ``vae``, ``text_encoder``, ``text_encoder_2``,
        ``tokenizer``, ``tokenizer_2``, ``scheduler`` and optionally ``text_encoder_3`` /
        ``tokenizer_3``. Compiled blocks (deploy ``compile: true``) are set up on these modules."""
        from .compile import compile_blocks, compile_options

        tf, vae = components["transformer"], components["vae"]
        for name in ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "scheduler"):
            if components.get(name) is None:
                raise CheckpointError(f"component {name!r} is missing")
        vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        patch = int(tf.config.patch_size)
        task_defaults = defaults_for(int(tf.config.sample_size), vae_scale, defaults)
        has_dual = bool(tf.config.get("dual_attention_layers"))
        config: dict[str, Any] = {
            "variant": variant or ("sd3.5-medium" if has_dual else "sd3.5" if tf.config.get("qk_norm") else "sd3"),
            "tasks": TASKS,
            "size_multiple": vae_scale * patch,
            "max_size": int(tf.config.pos_embed_max_size or 96) * patch * vae_scale,
            "task_defaults": task_defaults,
            "options": dict(options or {}),
        }
        model = LoadedModel(
            family=self.name, path=path, components=components, config=config,
            device=device if device is not None else torch.device("cpu"), dtype=dtype,
            weight_version=weight_version or f"in-memory:{id(tf):x}", defaults=dict(task_defaults),
        )
        opts = dict(options or {})
        check_options(opts)
        qkv = opts.get("qkv", "separate")
        backend = opts.get("attention")
        if qkv == "fused" or getattr(backend, "name", "sdpa") != "sdpa":
            from .attention import install

            install(tf, backend, fused_qkv=qkv == "fused")
            config["attention_backend"] = getattr(backend, "name", "sdpa")
        config["qkv"] = qkv
        copts = compile_options(opts)
        if copts is not None:
            compile_blocks(tf, **copts)
            config["compile"] = copts
        for task in TASKS:  # an incompatible scheduler config or policies option fails at load
            menu_for(model, task, options)
        return model

    # -- pipelines ----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → [image_encode] → denoise → vae_decode → output."""
        from .denoise import Denoise

        if task not in TASKS:
            raise RequestError("task", f"the sd3 family does not do {task.value!r} (it does: i2i, t2i)")
        text = {"prompt_embeds": Embeddings, "negative_embeds": Embeddings}
        nodes = [
            Node("validate", Validate(model), writes={"params": Conditioning}),
            Node("text_encode", TextEncode(), reads={"params": Conditioning}, writes=text,
                 params_schema=TextParams, uses=("text_encoder", "text_encoder_2", "text_encoder_3")),
        ]
        reads: dict[str, type] = {"params": Conditioning, **text}
        if task is TaskType.I2I:
            nodes.append(Node("image_encode", ImageEncode(), reads={"params": Conditioning, **text},
                              writes={"image_latents": Tensors}, when=is_i2i, uses=("vae",)))
            reads["image_latents"] = Tensors
        nodes += [
            Node("denoise", Denoise(menu_for(model, task)), reads=reads, writes={"denoised": Latents},
                 optional_reads=frozenset({"image_latents"}), params_schema=SD3DenoiseParams, uses=("transformer",)),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("output", Output(), reads={"decoded": Tensors, "denoised": Latents},
                 writes={"image": Image, "latents": Latents}),
        ]
        return PipelineSpec(family=self.name, task=task, nodes=nodes, outputs={"image": "image", "latents": "latents"})

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        return dict(model.config["task_defaults"][TaskType(task)])

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *, node_params: Any = None) -> SD3Params:
        """The request resolved once, before any compute (``Runtime.prepare`` calls this; the
        validate node passes it on). Raises ``RequestError`` naming the field."""
        params, _ = resolve(model, request, limits, node_params=node_params)
        return params

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        _, warnings = resolve(model, request, limits, decode_image=False)
        return warnings


def check_options(options: Mapping[str, Any]) -> None:
    """The family options (``qkv``, ``compile_*``), checked before loading."""
    from .compile import compile_options

    qkv = options.get("qkv", "separate")
    if qkv not in ("separate", "fused"):
        raise DeployError(f"options.qkv: must be 'separate' or 'fused', not {qkv!r}")
    compile_options(options)


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """Components and transformer architecture of a checkpoint, from its configs only."""
    root = ck.resolve_root(path)
    index = ck.check_checkpoint(root)
    tf = ck.read_json(root / "transformer" / "config.json", "transformer config")
    return {
        "path": str(root),
        "components": ck.components_in(index),
        "qk_norm": tf.get("qk_norm"),
        "dual_attention_layers": list(tf.get("dual_attention_layers") or []),
        "model_index": json.loads((root / "model_index.json").read_text()),
    }


__all__ = ["SD3Family", "check_options", "describe_checkpoint"]
