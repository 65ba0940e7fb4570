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

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as kit
from omniloop_kit.checkpoint import declared as declared
from omniloop_kit.checkpoint import load_component as load_model  # noqa: F401  (family.py: ck.load_model)
from omniloop_kit.checkpoint import weight_version as weight_version  # re-exported (family.py: ck.weight_version)
from omniloop_kit.checkpoints import read_json
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)

PIPELINES = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
REQUIRED = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
#: may be declared ``[null, null]``; then both are absent (diffusers: T5 context of zeros)
OPTIONAL_PAIR = ("text_encoder_3", "tokenizer_3")
LAYOUT = kit.Layout(what="an SD3 checkpoint", pipelines=PIPELINES, transformer_class="SD3Transformer2DModel",
                    required=REQUIRED, optional=OPTIONAL_PAIR)


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout (omniloop-kit) and the configs' consistency; return the parsed
    ``model_index.json``. Reads configs and safetensors headers only."""
    index, present = kit.read_index(root, LAYOUT)
    if ("text_encoder_3" in present) != ("tokenizer_3" in present):
        have, miss = ("text_encoder_3", "tokenizer_3") if "text_encoder_3" in present else ("tokenizer_3", "text_encoder_3")
        raise CheckpointError(f"{root / 'model_index.json'}: {have!r} is declared but {miss!r} is not (T5 needs both)")
    kit.check_folders(root, LAYOUT, present)
    check_consistency(root, index)
    return index


def _dim(cfg: dict[str, Any], key: str, path: Path) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def check_consistency(root: Path, index: dict[str, Any]) -> None:
    """The components must fit together (what the transformer expects of the encoders and the VAE)."""
    tf_path = root / "transformer" / "config.json"
    tf = read_json(tf_path, "transformer config")
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


def limits(path: Path) -> Any:
    """A real checkpoint's trained size (issue 42, ``capabilities.checkpoint_limits``): the
    transformer config's ``sample_size`` times the VAE's scale (1024 for SD3 / SD3.5), a ``warn``
    declaration; None with an ``omniloop.json``."""
    root = resolve_root(path)
    latent = kit.config_of(root, "transformer").get("sample_size")
    blocks = kit.config_of(root, "vae").get("block_out_channels") or [0, 0, 0, 0]
    size = int(latent) * 2 ** (len(blocks) - 1) if isinstance(latent, int) and latent > 0 else None
    return kit.sample_size_limits(root, height=size, width=size, source="transformer/config.json sample_size")
