"""Reading a diffusers-format FLUX.1 checkpoint from disk: find it, check it, load it.

Nothing is downloaded: every load is ``local_files_only``. Every problem with the files on disk —
a missing folder, a config that is not JSON, a weight file cut short, configs that disagree with
each other — becomes one :class:`omniloop.errors.CheckpointError` naming the file, and all of it is
checked by :func:`check_checkpoint` *before* any weight is read.

Layout (what the black-forest-labs ``FLUX.1-dev`` / ``FLUX.1-schnell`` repositories ship)::

    model_index.json     _class_name FluxPipeline; each component as [library, class]
    transformer/         FluxTransformer2DModel: config.json + diffusion_pytorch_model*.safetensors
    vae/                 AutoencoderKL
    text_encoder/        CLIPTextModel (pooled prompt embedding)
    text_encoder_2/      T5EncoderModel (the token states)
    tokenizer/           the class model_index.json names (CLIPTokenizer)
    tokenizer_2/         the class model_index.json names (T5TokenizerFast)
    scheduler/           scheduler_config.json (FlowMatchEulerDiscreteScheduler)
    omniloop.json        optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

Tokenizers and text encoders are built from the class ``model_index.json`` names, the way
diffusers' ``DiffusionPipeline.from_pretrained`` does (``getattr(transformers, name)``), so a
checkpoint may ship a generic fast tokenizer backed by ``tokenizer.json``, or vocab/merges files,
or a sentencepiece model — whatever that class reads. A Hugging Face cache folder
(``models--Org--Name``, or its ``snapshots/<hash>``) works too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoints
from omniloop_kit.checkpoints import (
    DIFFUSERS_WEIGHTS,
    TRANSFORMERS_WEIGHTS,
    component_folder,
    looks_like,
    model_folder,
    peek_json,
    read_json,
    read_model_index,
)
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)

#: pipeline classes of the FLUX.1 text-to-image / image-to-image checkpoints this family runs
PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline")
REQUIRED = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
#: library each component's class must come from
LIBRARY = {
    "transformer": "diffusers", "vae": "diffusers", "scheduler": "diffusers",
    "text_encoder": "transformers", "text_encoder_2": "transformers",
    "tokenizer": "transformers", "tokenizer_2": "transformers",
}
#: files one of which a tokenizer folder must hold (what transformers' tokenizer classes read)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model", "vocab.txt")


def looks_like_flux(path: str | Path) -> bool:
    """Cheap detection: reads ``model_index.json`` (and ``transformer/config.json``) only."""
    return looks_like(path, PIPELINES, "FluxTransformer2DModel", _plain_flux)


def _plain_flux(root: Path, index: dict[str, Any], tf: dict[str, Any]) -> bool:
    """A checkpoint saved by another pipeline class, judged by its transformer: FLUX.1 Fill /
    Control / Kontext transformers take other inputs, recognised by their in_channels."""
    vae = peek_json(root / "vae" / "config.json")
    return (
        vae is not None
        and int(tf.get("in_channels", 64)) == 4 * int(vae.get("latent_channels", 16))
        and not str(index.get("_class_name", "")).startswith(("FluxFill", "FluxControl", "FluxKontext"))
    )


# --------------------------------------------------------------------------------------------
# Checking the files (before anything heavy is loaded)
# --------------------------------------------------------------------------------------------


def class_of(index: dict[str, Any], name: str) -> str:
    entry = index.get(name)
    return str(entry[1])


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout and the configs against each other; return the parsed ``model_index.json``.

    Checks every component's folder, config and weight files (a truncated safetensors file from
    its header), that the classes ``model_index.json`` names exist in their library, and that the
    configs fit together (latent channels, text widths) — without loading any tensor.
    """
    index_path = root / "model_index.json"
    index = read_model_index(root)
    for name in REQUIRED:
        entry = index.get(name)
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1]):
            raise CheckpointError(
                f"{index_path}: component {name!r} is not declared (a FLUX.1 checkpoint needs "
                + ", ".join(REQUIRED) + ")"
            )
        lib = LIBRARY[name]
        if entry[0] != lib:
            raise CheckpointError(f"{index_path}: component {name!r} must come from {lib}, not {entry[0]!r}")
        _library_class(lib, str(entry[1]), f"{index_path}: component {name!r}")
    configs: dict[str, dict[str, Any]] = {}
    for name in REQUIRED:
        folder = component_folder(root, name)
        if name in ("transformer", "vae"):
            configs[name] = model_folder(folder, name, DIFFUSERS_WEIGHTS, allow_bin=False)
        elif name.startswith("text_encoder"):
            configs[name] = model_folder(folder, name, TRANSFORMERS_WEIGHTS, allow_bin=False)
        elif name.startswith("tokenizer"):
            if not any((folder / f).exists() for f in TOKENIZER_FILES):
                raise CheckpointError(f"{folder}: tokenizer has none of {', '.join(TOKENIZER_FILES)}")
            for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
                if (folder / f).exists() or (folder / f).is_symlink():
                    read_json(folder / f, f"tokenizer file {f}")
        else:
            configs[name] = read_json(folder / "scheduler_config.json", "scheduler config")
    check_consistency(root, configs)
    return index


def check_consistency(root: Path, cfg: dict[str, dict[str, Any]]) -> None:
    """The configs must describe one model: the transformer's input width is the VAE's latent
    channels times the 2x2 packing, its text widths are the encoders' widths."""
    tf, vae = cfg["transformer"], cfg["vae"]
    tf_path = root / "transformer" / "config.json"
    if tf.get("_class_name", "FluxTransformer2DModel") != "FluxTransformer2DModel":
        raise CheckpointError(f"{tf_path}: expected a FluxTransformer2DModel, found {tf.get('_class_name')!r}")
    latent = int(vae.get("latent_channels", 16))
    cin = int(tf.get("in_channels", 64))
    if cin != 4 * latent:
        raise CheckpointError(
            f"{tf_path}: in_channels={cin} does not fit the VAE's latent_channels={latent} "
            f"({root / 'vae' / 'config.json'}); FLUX packs 2x2 latent patches, so it must be {4 * latent}"
        )
    t5 = cfg["text_encoder_2"]
    t5_dim = t5.get("d_model", t5.get("hidden_size"))
    if t5_dim is not None and int(tf.get("joint_attention_dim", 4096)) != int(t5_dim):
        raise CheckpointError(
            f"{tf_path}: joint_attention_dim={tf.get('joint_attention_dim', 4096)} but the T5 encoder "
            f"({root / 'text_encoder_2' / 'config.json'}) is {t5_dim} wide"
        )
    clip = cfg["text_encoder"]
    clip_dim = clip.get("hidden_size", (clip.get("text_config") or {}).get("hidden_size"))
    if clip_dim is not None and int(tf.get("pooled_projection_dim", 768)) != int(clip_dim):
        raise CheckpointError(
            f"{tf_path}: pooled_projection_dim={tf.get('pooled_projection_dim', 768)} but the CLIP text encoder "
            f"({root / 'text_encoder' / 'config.json'}) is {clip_dim} wide"
        )
    heads_dim = int(tf.get("attention_head_dim", 128))
    axes = tf.get("axes_dims_rope", (16, 56, 56))
    if sum(int(a) for a in axes) != heads_dim:
        raise CheckpointError(f"{tf_path}: axes_dims_rope {list(axes)} must sum to attention_head_dim={heads_dim}")


def _library_class(lib: str, name: str, where: str) -> Any:
    import importlib

    module = importlib.import_module(lib)
    cls = getattr(module, name, None)
    if cls is None or not isinstance(cls, type):
        raise CheckpointError(f"{where}: {lib} has no class {name!r}")
    return cls


def weight_version(root: Path) -> str:
    """A cheap identity of the weights: names, sizes and modification times of the files."""
    return checkpoints.weight_version(root, REQUIRED)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide transformers' / diffusers' per-load progress bars and info logs (restored afterwards)."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        if was:
            tlog.enable_progress_bar()
        dlog.set_verbosity(level)


def load_component(index: dict[str, Any], root: Path, name: str, *, device: torch.device, dtype: torch.dtype) -> Any:
    """Load one component by the class ``model_index.json`` names (local files only)."""
    lib = LIBRARY[name]
    cls = _library_class(lib, class_of(index, name), f"{root / 'model_index.json'}: component {name!r}")
    folder = root / name
    try:
        with _quiet():
            if name.startswith("tokenizer"):
                return cls.from_pretrained(str(folder), local_files_only=True)
            if name == "scheduler":
                return cls.from_config(read_json(folder / "scheduler_config.json", "scheduler config"))
            if lib == "transformers":
                model = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
            else:
                model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
            # weights the files lack stay on the meta device (diffusers warns, does not raise)
            empty = [n for n, p in model.named_parameters() if p.is_meta]
            if empty:
                raise CheckpointError(
                    f"{folder}: cannot load {cls.__name__}: {len(empty)} weight(s) missing from its files "
                    f"(config and weights disagree?), e.g. {', '.join(empty[:3])}"
                )
            return model.to(device).eval().requires_grad_(False)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None
