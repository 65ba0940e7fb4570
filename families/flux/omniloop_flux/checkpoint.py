"""Reading a diffusers-format FLUX.1 checkpoint: its layout (omniloop-kit's checks and loading) and
how its configs must fit together.

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
diffusers' ``DiffusionPipeline.from_pretrained`` does, so a checkpoint may ship a generic fast
tokenizer backed by ``tokenizer.json``, or vocab/merges files, or a sentencepiece model. A Hugging
Face cache folder (``models--Org--Name``, or its ``snapshots/<hash>``) works too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as kit
from omniloop_kit.checkpoint import load_component as load_component  # re-exported (family.py: ck.load_component)
from omniloop_kit.checkpoints import peek_json, read_json
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)

#: pipeline classes of the FLUX.1 text-to-image / image-to-image checkpoints this family runs
PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline")
REQUIRED = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def _plain_flux(root: Path, index: dict[str, Any], tf: dict[str, Any]) -> bool:
    """A checkpoint saved by another pipeline class, judged by its transformer: FLUX.1 Fill /
    Control / Kontext transformers take other inputs, recognised by their in_channels."""
    vae = peek_json(root / "vae" / "config.json")
    return (
        vae is not None
        and int(tf.get("in_channels", 64)) == 4 * int(vae.get("latent_channels", 16))
        and not str(index.get("_class_name", "")).startswith(("FluxFill", "FluxControl", "FluxKontext"))
    )


LAYOUT = kit.Layout(what="a FLUX.1 checkpoint", pipelines=PIPELINES, transformer_class="FluxTransformer2DModel",
                    required=REQUIRED, allow_bin=False, accept=_plain_flux)


def class_of(index: dict[str, Any], name: str) -> str:
    return str(index[name][1])


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout (omniloop-kit) and the configs against each other; return the parsed
    ``model_index.json``. No tensor is loaded."""
    return kit.check_checkpoint(root, LAYOUT, lambda root, index, configs: check_consistency(root, configs))[0]


def check_consistency(root: Path, cfg: dict[str, dict[str, Any]]) -> None:
    """The configs must describe one model: the transformer's input width is the VAE's latent
    channels times the 2x2 packing, its text widths are the encoders' widths."""
    tf, vae = cfg["transformer"], cfg["vae"]
    tf_path = root / "transformer" / "config.json"
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


def weight_version(root: Path) -> str:
    """A cheap identity of the weights: names, sizes and modification times of the files."""
    return kit.weight_version(root, REQUIRED)


def limits(path: Path) -> Any:
    """A real checkpoint's trained size (issue 42, ``capabilities.checkpoint_limits``): its VAE
    config's ``sample_size`` (1024 for FLUX.1), a ``warn`` declaration; None for a checkpoint with
    an ``omniloop.json``."""
    root = resolve_root(path)
    size = kit.config_of(root, "vae").get("sample_size")
    size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    return kit.sample_size_limits(root, height=size, width=size, source="vae/config.json sample_size")


__all__ = ["LAYOUT", "PIPELINES", "REQUIRED", "check_checkpoint", "class_of", "load_component",
           "read_json", "resolve_root", "weight_version"]
