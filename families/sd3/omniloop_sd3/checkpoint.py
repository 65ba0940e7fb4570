"""Reading a diffusers-format SD3 / SD3.5 checkpoint from disk: find it, check it, load it.

Nothing is downloaded (every load is ``local_files_only``). :func:`check_checkpoint` validates the
whole layout from configs and file headers — before any weight is read — and every problem becomes
one :class:`omniloop.errors.CheckpointError` naming the file and what is wrong.

Layout (what stabilityai's ``stable-diffusion-3*-diffusers`` repositories ship)::

    model_index.json     _class_name StableDiffusion3Pipeline; [library, class] per component
    transformer/         SD3Transformer2DModel: config.json + diffusion_pytorch_model*.safetensors
    vae/                 AutoencoderKL (16 latent channels, shift_factor / scaling_factor)
    text_encoder/        CLIP-L  (CLIPTextModelWithProjection)
    text_encoder_2/      CLIP-G  (CLIPTextModelWithProjection)
    text_encoder_3/      T5      (T5EncoderModel); may be declared [null, null] (context part = zeros)
    tokenizer{,_2,_3}/   loaded by the class model_index.json names (CLIPTokenizer, T5TokenizerFast,
                         or a generic PreTrainedTokenizerFast backed by tokenizer.json)
    scheduler/           scheduler_config.json (FlowMatchEulerDiscreteScheduler, shift 3.0)
    omniloop.json        optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

A Hugging Face cache folder (``models--Org--Name`` or its ``snapshots/<hash>``) works too.
Component classes come from the checkpoint's own ``model_index.json`` (never from a request) and
must be classes of the library it names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)
from omniloop_kit.checkpoints import weight_version as weight_version  # re-exported (family.py: ck.weight_version)

PIPELINES = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
REQUIRED = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
#: may be declared ``[null, null]``; then both are absent (diffusers: T5 context of zeros)
OPTIONAL_PAIR = ("text_encoder_3", "tokenizer_3")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")
LIBRARIES = ("diffusers", "transformers")


# --------------------------------------------------------------------------------------------
# Finding the checkpoint
# --------------------------------------------------------------------------------------------


def looks_like_sd3(path: str | Path) -> bool:
    """Cheap detection: reads ``model_index.json`` (and ``transformer/config.json``) only."""
    return looks_like(path, PIPELINES, "SD3Transformer2DModel")


# --------------------------------------------------------------------------------------------
# Checking the files (before anything heavy is loaded)
# --------------------------------------------------------------------------------------------


def declared(index: dict[str, Any], name: str) -> tuple[str, str] | None:
    """``(library, class)`` of a component the index declares, None when absent or ``[null, null]``."""
    entry = index.get(name)
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] and entry[1]:
        return str(entry[0]), str(entry[1])
    return None


def components_in(index: dict[str, Any]) -> list[str]:
    return [n for n in REQUIRED + OPTIONAL_PAIR if declared(index, n) is not None]


def component_class(index: dict[str, Any], name: str, index_path: Path) -> Any:
    """The class ``model_index.json`` names for ``name``, looked up in the library it names."""
    entry = declared(index, name)
    if entry is None:
        raise CheckpointError(f"{index_path}: component {name!r} is not declared")
    library, cls_name = entry
    if library not in LIBRARIES:
        raise CheckpointError(
            f"{index_path}: component {name!r} comes from library {library!r}; only {', '.join(LIBRARIES)} are loaded"
        )
    import importlib

    module = importlib.import_module(library)
    cls = getattr(module, cls_name, None) if cls_name.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained" if name != "scheduler" else "from_config"):
        raise CheckpointError(f"{index_path}: component {name!r}: {library} has no loadable class {cls_name!r}")
    return cls


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout and the configs' consistency; return the parsed ``model_index.json``.

    Reads configs and safetensors headers only (a truncated weight file is caught here)."""
    index_path = root / "model_index.json"
    index = read_model_index(root)
    present = components_in(index)
    for name in REQUIRED:
        if name not in present:
            raise CheckpointError(
                f"{index_path}: component {name!r} is not declared (an SD3 checkpoint needs {', '.join(REQUIRED)})"
            )
    if ("text_encoder_3" in present) != ("tokenizer_3" in present):
        have, miss = ("text_encoder_3", "tokenizer_3") if "text_encoder_3" in present else ("tokenizer_3", "text_encoder_3")
        raise CheckpointError(f"{index_path}: {have!r} is declared but {miss!r} is not (T5 needs both)")
    for name in present:
        folder = component_folder(root, name)
        if name in ("transformer", "vae"):
            model_folder(folder, name, DIFFUSERS_WEIGHTS)
        elif name in TEXT_ENCODERS:
            model_folder(folder, name, TRANSFORMERS_WEIGHTS)
        elif name in TOKENIZERS:
            check_tokenizer(folder)
        elif name == "scheduler":
            read_json(folder / "scheduler_config.json", "scheduler config")
    check_consistency(root, index)
    return index


def check_tokenizer(folder: Path) -> None:
    files = ("tokenizer.json", "vocab.json", "spiece.model")
    if not any((folder / f).exists() for f in files):
        raise CheckpointError(f"{folder}: tokenizer has none of {', '.join(files)}")
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer.json").is_symlink():
        read_json(folder / "tokenizer.json", "tokenizer file")
    elif (folder / "vocab.json").exists() and not (folder / "merges.txt").exists():
        raise CheckpointError(f"{folder / 'merges.txt'}: a BPE tokenizer with vocab.json needs merges.txt (missing)")


def _dim(cfg: dict[str, Any], key: str, path: Path) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def check_consistency(root: Path, index: dict[str, Any]) -> None:
    """The components must fit together (what the transformer expects of the encoders and the VAE)."""
    tf_path = root / "transformer" / "config.json"
    tf = read_json(tf_path, "transformer config")
    if tf.get("_class_name", "SD3Transformer2DModel") != "SD3Transformer2DModel":
        raise CheckpointError(f"{tf_path}: expected an SD3Transformer2DModel, found {tf.get('_class_name')!r}")
    vae_path = root / "vae" / "config.json"
    vae = read_json(vae_path, "vae config")
    in_ch = int(tf.get("in_channels", 16))
    if int(vae.get("latent_channels", 4)) != in_ch:
        raise CheckpointError(
            f"{vae_path}: latent_channels={vae.get('latent_channels')} but the transformer takes in_channels={in_ch}"
        )
    clip_hidden, clip_proj = 0, 0
    for name in ("text_encoder", "text_encoder_2"):
        path = root / name / "config.json"
        cfg = read_json(path, f"{name} config")
        cfg = cfg.get("text_config", cfg)
        clip_hidden += _dim(cfg, "hidden_size", path)
        clip_proj += _dim(cfg, "projection_dim", path) if "projection_dim" in cfg else _dim(cfg, "hidden_size", path)
    pooled = int(tf.get("pooled_projection_dim", 2048))
    if clip_proj != pooled:
        raise CheckpointError(
            f"{tf_path}: pooled_projection_dim={pooled} but the two CLIP encoders project to {clip_proj} together"
        )
    joint = int(tf.get("joint_attention_dim", 4096))
    if clip_hidden > joint:
        raise CheckpointError(
            f"{tf_path}: joint_attention_dim={joint} is smaller than the CLIP states ({clip_hidden} = CLIP-L + CLIP-G)"
        )
    if declared(index, "text_encoder_3") is not None:
        path = root / "text_encoder_3" / "config.json"
        t5 = read_json(path, "text_encoder_3 config")
        d = t5.get("d_model", t5.get("hidden_size"))
        if d != joint:
            raise CheckpointError(f"{path}: d_model={d} but the transformer's joint_attention_dim is {joint}")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide transformers' / diffusers' per-load progress bars (restored afterwards)."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was_t, was_d = tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    dlog.disable_progress_bar()
    try:
        yield
    finally:
        if was_t:
            tlog.enable_progress_bar()
        if was_d:
            dlog.enable_progress_bar()


def load_model(cls: Any, folder: Path, *, device: torch.device, dtype: torch.dtype) -> Any:
    """A diffusers or transformers model from ``folder`` (local files only), errors as ``CheckpointError``."""
    try:
        with _quiet():
            try:
                model = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
            except TypeError:  # older transformers / diffusers spell it torch_dtype
                model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(cls: Any, folder: Path) -> Any:
    try:
        with _quiet():
            return cls.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None


def load_scheduler(cls: Any, folder: Path) -> Any:
    """The scheduler *template*: each request's sampler builds its own instance from its config."""
    config = read_json(folder / "scheduler_config.json", "scheduler config")
    name = config.get("_class_name")
    if name and name != cls.__name__:
        import diffusers

        cls = getattr(diffusers, str(name), None) if str(name).isidentifier() else None
        if cls is None or not hasattr(cls, "from_config"):
            raise CheckpointError(f"{folder / 'scheduler_config.json'}: unknown scheduler class {name!r}")
    try:
        return cls.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{folder / 'scheduler_config.json'}: cannot build {cls.__name__} ({exc})") from None
