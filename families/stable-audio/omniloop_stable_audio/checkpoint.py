"""Reading a diffusers-format Stable Audio checkpoint: detect it, check it, load it.

Layout (what ``stabilityai/stable-audio-open-1.0`` ships)::

    model_index.json     _class_name StableAudioPipeline; [library, class] per component
    transformer/         StableAudioDiTModel (config.json + diffusion_pytorch_model*.safetensors)
    vae/                 AutoencoderOobleck (sampling_rate, audio_channels, downsampling_ratios)
    text_encoder/        T5EncoderModel
    tokenizer/           T5 tokenizer (model_max_length: the prompt's token budget, 128)
    projection_model/    StableAudioProjectionModel (["stable_audio", ...]: diffusers' pipeline module)
    scheduler/           CosineDPMSolverMultistepScheduler config
    omniloop.json        optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

Stable Audio 3 (``_class_name`` ``StableAudio3Pipeline``): ``transformer/`` StableAudio3DiTModel,
``vae/`` AutoencoderSAME, ``text_encoder/`` T5GemmaEncoderModel, ``tokenizer/`` Gemma tokenizer,
``duration_embedder/`` StableAudio3DurationEmbedder (``["stable_audio_3", ...]``), ``scheduler/``
FlowMatchEulerDiscreteScheduler. :func:`pipeline_of` reads the variant from ``model_index.json``.

:func:`check_checkpoint` validates the layout from configs and safetensors headers before any
weight is read, including that the components fit together; every problem is one
:class:`omniloop.errors.CheckpointError` naming the file. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit.checkpoints import (
    DIFFUSERS_WEIGHTS,
    TRANSFORMERS_WEIGHTS,
    component_folder,
    looks_like,
    model_folder,
    read_json,
    read_model_index,
)
from omniloop_kit.loading import declared

SA1, SA3 = "StableAudioPipeline", "StableAudio3Pipeline"
PIPELINES = (SA1, SA3)
REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer", "projection_model", "scheduler")
#: Stable Audio 3: T5Gemma text encoder, duration embedder, SAME autoencoder, flow-match scheduler
REQUIRED_3 = ("transformer", "vae", "text_encoder", "tokenizer", "duration_embedder", "scheduler")
#: the diffusers pipeline modules a component may name as its library
PIPELINE_MODULES = ("stable_audio", "stable_audio_3")
SCHEDULERS = ("CosineDPMSolverMultistepScheduler",)
SCHEDULERS_3 = ("FlowMatchEulerDiscreteScheduler",)
#: the component folders holding diffusers weights, per pipeline
DIFFUSERS_COMPONENTS = {SA1: ("transformer", "vae", "projection_model"),
                        SA3: ("transformer", "vae", "duration_embedder")}


def looks_like_stable_audio(path: str | Path) -> bool:
    """Cheap detection: reads ``model_index.json`` (and ``transformer/config.json``) only."""
    return looks_like(path, PIPELINES, "StableAudioDiTModel") or looks_like(path, PIPELINES, "StableAudio3DiTModel")


def pipeline_of(index: dict[str, Any], transformer: dict[str, Any] | None = None) -> str:
    """``StableAudio3Pipeline`` or ``StableAudioPipeline``: the variant, from ``model_index.json``
    (a checkpoint saved by another pipeline class: from the transformer's class)."""
    name = index.get("_class_name")
    if name in PIPELINES:
        return str(name)
    return SA3 if (transformer or {}).get("_class_name") == "StableAudio3DiTModel" else SA1


def required(pipeline: str) -> tuple[str, ...]:
    return REQUIRED_3 if pipeline == SA3 else REQUIRED


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout and the configs' fit; return ``{"index": ..., "pipeline": SA1 | SA3,
    "<name>": config, ...}``."""
    index_path = root / "model_index.json"
    index = read_model_index(root)
    tf = root / "transformer" / "config.json"
    pipeline = pipeline_of(index, read_json(tf, "transformer config") if tf.exists() else None)
    configs: dict[str, Any] = {"index": index, "pipeline": pipeline}
    names = required(pipeline)
    for name in names:
        if declared(index, name) is None:
            raise CheckpointError(f"{index_path}: component {name!r} is not declared "
                                  f"(a {pipeline} checkpoint needs {', '.join(names)})")
        folder = component_folder(root, name)
        if name in DIFFUSERS_COMPONENTS[pipeline]:
            configs[name] = model_folder(folder, name, DIFFUSERS_WEIGHTS)
        elif name == "text_encoder":
            configs[name] = model_folder(folder, name, TRANSFORMERS_WEIGHTS)
        elif name == "tokenizer":
            if not any((folder / f).exists() for f in ("tokenizer.json", "spiece.model", "tokenizer.model")):
                raise CheckpointError(f"{folder}: tokenizer has no tokenizer.json, spiece.model or tokenizer.model")
        else:
            configs[name] = read_json(folder / "scheduler_config.json", "scheduler config")
    (check_fit_3 if pipeline == SA3 else check_fit)(root, configs)
    return configs


def _int(cfg: dict[str, Any], key: str, path: Path, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def _dit_and_vae(root: Path, c: dict[str, Any], dit: str, tf_key: str, vae_key: str, default: int) -> None:
    """The DiT's class, its latent channels (``tf_key``) against the VAE's (``vae_key``), the rate."""
    tf_path, vae_path = root / "transformer" / "config.json", root / "vae" / "config.json"
    tf, vae = c["transformer"], c["vae"]
    if tf.get("_class_name", dit) != dit:
        raise CheckpointError(f"{tf_path}: expected a {dit}, found {tf.get('_class_name')!r}")
    latent = _int(tf, tf_key, tf_path, default)
    if _int(vae, vae_key, vae_path, default) != latent:
        raise CheckpointError(f"{vae_path}: {vae_key}={vae.get(vae_key, default)} but the transformer takes "
                              f"{tf_key}={latent}")
    _int(vae, "sampling_rate", vae_path, 44100)


def _scheduler(root: Path, c: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    name = c["scheduler"].get("_class_name")
    if name not in allowed:
        raise CheckpointError(f"{root / 'scheduler' / 'scheduler_config.json'}: scheduler {name!r} is not supported "
                              f"(the family steps {', '.join(allowed)} for {what}, what it ships)")


def check_fit(root: Path, c: dict[str, Any]) -> None:
    """The components must fit together (what the DiT expects of the projection, the T5 and the VAE)."""
    tf_path = root / "transformer" / "config.json"
    pr_path, te_path = root / "projection_model" / "config.json", root / "text_encoder" / "config.json"
    tf, pr, te = c["transformer"], c["projection_model"], c["text_encoder"]
    _dit_and_vae(root, c, "StableAudioDiTModel", "in_channels", "decoder_input_channels", 64)
    cond = _int(pr, "conditioning_dim", pr_path)
    if _int(tf, "cross_attention_input_dim", tf_path, 768) != cond:
        raise CheckpointError(f"{tf_path}: cross_attention_input_dim={tf.get('cross_attention_input_dim', 768)} but "
                              f"the projection model's conditioning_dim is {cond}")
    if _int(tf, "global_states_input_dim", tf_path, 1536) != 2 * cond:
        raise CheckpointError(f"{tf_path}: global_states_input_dim={tf.get('global_states_input_dim', 1536)} must be "
                              f"twice the projection model's conditioning_dim ({2 * cond}: start and end seconds)")
    width = te.get("d_model", te.get("hidden_size"))
    if width != pr.get("text_encoder_dim"):
        raise CheckpointError(f"{pr_path}: text_encoder_dim={pr.get('text_encoder_dim')!r} but the text encoder's "
                              f"d_model is {width!r} ({te_path})")
    lo, hi = pr.get("min_value"), pr.get("max_value")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) or not lo < hi:
        raise CheckpointError(f"{pr_path}: min_value/max_value must be numbers with min < max, got {lo!r}/{hi!r}")
    if (_int(tf, "attention_head_dim", tf_path, 64) // 2) % 2:
        raise CheckpointError(f"{tf_path}: attention_head_dim must be a multiple of 4 (half of it is rotated)")
    _scheduler(root, c, SCHEDULERS, "Stable Audio Open")


def check_fit_3(root: Path, c: dict[str, Any]) -> None:
    """Stable Audio 3: the DiT's widths vs the T5Gemma encoder, the duration embedder and the SAME
    latents; the duration range; the flow-match scheduler."""
    tf_path = root / "transformer" / "config.json"
    de_path, te_path = root / "duration_embedder" / "config.json", root / "text_encoder" / "config.json"
    tf, de, te = c["transformer"], c["duration_embedder"], c["text_encoder"]
    _dit_and_vae(root, c, "StableAudio3DiTModel", "io_channels", "latent_dim", 256)
    _int(tf, "patch_size", tf_path, 1)
    cond = _int(tf, "cond_token_dim", tf_path, 768)
    width = (te.get("encoder") or {}).get("hidden_size", te.get("hidden_size"))
    if width != cond:
        raise CheckpointError(f"{tf_path}: cond_token_dim={cond} but the text encoder's hidden_size is {width!r} "
                              f"({te_path})")
    out = _int(de, "output_dim", de_path, 768)
    if out != cond or _int(tf, "global_cond_dim", tf_path, 768) != out:
        raise CheckpointError(f"{de_path}: output_dim={out} must equal the transformer's cond_token_dim ({cond}) and "
                              f"global_cond_dim ({tf.get('global_cond_dim', 768)}): the duration is a context token "
                              "and the global input")
    lo, hi = de.get("min_val", 0.0), de.get("max_val", 384.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo < hi:
        raise CheckpointError(f"{de_path}: min_val/max_val must be numbers with 0 <= min < max, got {lo!r}/{hi!r}")
    _scheduler(root, c, SCHEDULERS_3, "Stable Audio 3")


__all__ = ["DIFFUSERS_COMPONENTS", "PIPELINES", "PIPELINE_MODULES", "REQUIRED", "REQUIRED_3", "SA1", "SA3",
           "SCHEDULERS", "SCHEDULERS_3", "check_checkpoint", "check_fit", "check_fit_3", "looks_like_stable_audio",
           "pipeline_of", "required"]
