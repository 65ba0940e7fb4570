"""The Stable Audio family: detect, load, build the ``t2a`` pipeline, resolve requests."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Audio, Conditioning, Embeddings, Latents, Tensors
from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import CheckpointError, DeployError, RequestError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kit import loading
from omniloop_kit.checkpoints import read_json, resolve_root, weight_version
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS

from . import checkpoint as ck
from .resolve import DEFAULTS, DEFAULTS_3, AudioResolved, audio_config, audio_config_3, resolve
from .stages import Output, TextEncode, VaeDecode, Validate

TASKS = frozenset({TaskType.T2A})
#: deploy options read (the compile settings of omniloop_kit.compile; cuda_graphs: omniloop_stable_audio.graphs; noise_prefetch: omniloop_stable_audio.noise)
OPTIONS = frozenset({"cuda_graphs", "noise_prefetch", *COMPILE_KEYS})


class StableAudioFamily:
    """Stable Audio text-to-audio from diffusers-format ``StableAudioPipeline`` (Stable Audio Open)
    and ``StableAudio3Pipeline`` checkpoints (the variant read from ``model_index.json``)."""

    name = "stable-audio"
    tasks = TASKS
    capabilities = FamilyCapabilities(
        #: the DiT's blocks run through run_blocks (cache-dit, fbcache, block taps)
        block_interceptors=True,
        returns_latents=True,
        #: Denoise.step_batch and VaeDecode.step_batch change no request state before their
        #: batched forward returns (rows gathered, forward, then each request's combine + step)
        step_batch_retry_alone={"denoise", "vae_decode"},
        #: it makes audio and reads request.audio (the window: seconds, start)
        audio=True,
        options=OPTIONS,
        resolve=True, task_defaults=True, inspect=True,
    )

    # -- detect / load ------------------------------------------------------------------------
    def detect(self, path: Path) -> bool:
        return ck.looks_like_stable_audio(path)

    def inspect(self, path: Path, *, options: Mapping[str, Any] | None = None) -> LoadedModel:
        """The checkpoint's configs only (no weights): enough to resolve requests (``Deployment.check``)."""
        root = resolve_root(path)
        configs = ck.check_checkpoint(root)
        return LoadedModel(family=self.name, path=root, components={}, config=self._config(root, configs),
                           device=torch.device("cpu"), dtype=torch.float32)

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        """Check every file first (configs, headers, the components' fit), then load each component
        by the class ``model_index.json`` names (local files only). Deploy ``compile: true``
        compiles each DiT block (:mod:`omniloop_stable_audio.compile`); the deploy's
        ``attention_backend`` runs the DiT's attention (:mod:`omniloop_stable_audio.attention`)."""
        from .compile import compile_options
        from .graphs import graph_option, prefetch_option

        compile_options(options)  # bad options fail before any weight is read
        graph_option(options, device)
        prefetch_option(options)
        root = resolve_root(path)
        configs = ck.check_checkpoint(root)
        index, index_path = configs["index"], root / "model_index.json"
        names = ck.required(configs["pipeline"])
        comps: dict[str, Any] = {}
        for name in (n for n in names if n not in ("tokenizer", "scheduler")):
            cls = loading.component_class(index, name, index_path, ck.PIPELINE_MODULES)
            with warnings.catch_warnings():
                # diffusers' Oobleck VAE is built with torch.nn.utils.weight_norm, whose FutureWarning
                # (deprecated for parametrizations.weight_norm) every load printed to users
                warnings.filterwarnings("ignore", message=r"`torch\.nn\.utils\.weight_norm` is deprecated",
                                        category=FutureWarning)
                comps[name] = loading.load_model(cls, root / name, device=device, dtype=dtype)
        comps["tokenizer"] = loading.load_tokenizer(
            loading.component_class(index, "tokenizer", index_path), root / "tokenizer")
        sched_cls = loading.component_class(index, "scheduler", index_path)
        comps["scheduler"] = loading.load_scheduler(sched_cls, configs["scheduler"],
                                                    root / "scheduler" / "scheduler_config.json")
        model = LoadedModel(family=self.name, path=root, components=comps, config=self._config(root, configs),
                            device=device, dtype=dtype, weight_version=weight_version(root, [n for n in names if n != "scheduler"]))
        self._setup(model, options)
        return model

    def _config(self, root: Path, configs: dict[str, Any]) -> dict[str, Any]:
        extra_path = root / "omniloop.json"
        extra = read_json(extra_path, "omniloop.json") if extra_path.exists() else {}
        overrides = extra.get("defaults") or {}
        sa3 = configs["pipeline"] == ck.SA3
        base = DEFAULTS_3 if sa3 else DEFAULTS
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            raise CheckpointError(f"{extra_path}: defaults.{unknown[0]} is not a {configs['pipeline']} default "
                                  f"(it takes: {', '.join(base)})")
        config = (audio_config_3(configs["transformer"], configs["vae"], configs["duration_embedder"],
                                 configs["scheduler"]) if sa3 else
                  audio_config(configs["transformer"], configs["vae"], configs["projection_model"]))
        config.update(variant=extra.get("variant", "stable-audio-3" if sa3 else "stable-audio"), tasks=TASKS,
                      defaults={**base, **overrides})
        return config

    def from_components(self, components: dict[str, Any], *, defaults: dict[str, Any] | None = None,
                        options: Mapping[str, Any] | None = None, device: torch.device | None = None,
                        dtype: torch.dtype = torch.float32) -> LoadedModel:
        """A ``LoadedModel`` over modules already in memory (benchmarks, tests): ``transformer``,
        ``vae``, ``text_encoder``, ``projection_model``, ``tokenizer``, ``scheduler`` (Stable Audio
        3: ``duration_embedder`` in place of ``projection_model``)."""
        c = components
        if "duration_embedder" in c:
            config = audio_config_3(dict(c["transformer"].config), dict(c["vae"].config),
                                    dict(c["duration_embedder"].config), dict(c["scheduler"].config))
            base = DEFAULTS_3
        else:
            config = audio_config(dict(c["transformer"].config), dict(c["vae"].config),
                                  dict(c["projection_model"].config))
            base = DEFAULTS
        config.update(variant="in-memory", tasks=TASKS, defaults={**base, **(defaults or {})})
        model = LoadedModel(family=self.name, path=None, components=dict(c), config=config,
                            device=device if device is not None else torch.device("cpu"), dtype=dtype,
                            weight_version=f"in-memory:{id(c['transformer']):x}")
        self._setup(model, dict(options or {}))
        return model

    def _setup(self, model: LoadedModel, options: Mapping[str, Any]) -> None:
        """The deploy's attention backend and regional compilation on the loaded DiT."""
        from .compile import compile_blocks, compile_options

        tf = model.components["transformer"]
        backend = options.get("attention")
        name = getattr(backend, "name", "sdpa")
        if name != "sdpa" and model.config["pipeline"] == ck.SA3:
            raise DeployError(f"attention_backend: {name!r} is not available for Stable Audio 3 (its differential "
                              "attention runs on diffusers' processors: sdpa only)")
        if name != "sdpa":
            from .attention import install

            install(tf, backend)
        model.config["attention_backend"] = name
        from .graphs import graph_option, prefetch_option

        if graph_option(options, model.device) and model.config["pipeline"] == ck.SA3:
            raise DeployError("options.cuda_graphs: not available for Stable Audio 3 (its forward is not captured)")
        if prefetch_option(options) and model.config["pipeline"] == ck.SA3:
            raise DeployError("options.noise_prefetch: Stable Audio 3's scheduler draws one randn per step (no "
                              "Brownian tree to prefetch)")
        copts = compile_options(options)
        if copts is not None:
            compile_blocks(tf, **copts)
            model.config["compile"] = copts

    # -- pipeline -----------------------------------------------------------------------------
    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        """validate → text_encode → denoise → vae_decode → output."""
        from . import sa3
        from .denoise import Denoise

        if task not in TASKS:
            raise RequestError("task", f"the stable-audio family does text-to-audio (t2a), not {task.value!r}")
        is3 = model.config["pipeline"] == ck.SA3
        return PipelineSpec(family=self.name, task=task, outputs={"audio": "audio", "latents": "latents"}, nodes=(
            Node("validate", Validate(model), writes={"params": Conditioning}),
            Node("text_encode", TextEncode(), reads={"params": Conditioning}, writes={"conditioning": Embeddings},
                 uses=("text_encoder", "duration_embedder" if is3 else "projection_model")),
            Node("denoise", sa3.Denoise() if is3 else Denoise(), reads={"params": Conditioning, "conditioning": Embeddings},
                 writes={"denoised": Latents}, uses=("transformer",)),
            Node("vae_decode", VaeDecode(), reads={"denoised": Latents}, writes={"decoded": Tensors}, uses=("vae",)),
            Node("output", Output(), reads={"params": Conditioning, "decoded": Tensors, "denoised": Latents},
                 writes={"audio": Audio, "latents": Latents}),
        ))

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        d, cfg = model.config["defaults"], model.config
        if cfg["pipeline"] == ck.SA3:
            steps = d["steps"] if d["steps"] is not None else (8 if cfg["stochastic"] else 100)
            return {"steps": steps, "guidance_scale": d["guidance_scale"],
                    "seconds": min(d["seconds"], cfg["max_seconds"]), "sample_rate": cfg["sample_rate"]}
        return {"steps": d["steps"], "guidance_scale": d["guidance_scale"], "seconds": cfg["max_seconds"],
                "sample_rate": cfg["sample_rate"]}

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *, node_params: Any = None) -> AudioResolved:
        """The request resolved once, before any compute; raises ``RequestError`` naming the field."""
        return resolve(model, request)

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        return list(resolve(model, request).warnings)


__all__ = ["OPTIONS", "TASKS", "StableAudioFamily"]
