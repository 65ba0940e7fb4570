"""Reading a diffusers-format Wan checkpoint from disk: its layout (omniloop-kit's checks and
loading), Wan2.2's ``boundary_ratio``, the checks that need the configs and the classes it loads.

Nothing is downloaded: every load is ``local_files_only``. Every problem with the files on disk —
a missing folder, a config that is not JSON, a weight file cut short, a tensor of the wrong shape —
becomes one :class:`omniloop.errors.CheckpointError` that names the file and what is wrong.

Layout (what Wan-AI's ``*-Diffusers`` repositories ship)::

    model_index.json          _class_name WanPipeline | WanImageToVideoPipeline, boundary_ratio, expand_timesteps
    transformer/              config.json + diffusion_pytorch_model*.safetensors (sharded: *.index.json)
    transformer_2/            Wan2.2 A14B: the low-noise expert
    vae/                      AutoencoderKLWan
    text_encoder/             UMT5EncoderModel (transformers)
    tokenizer/                tokenizer.json and/or spiece.model
    scheduler/                scheduler_config.json
    image_encoder/, image_processor/   Wan2.1 I2V: CLIP vision model and its processor
    omniloop.json             optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

A Hugging Face cache folder (``models--Org--Name``, or its ``snapshots/<hash>``) works too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as kit
from omniloop_kit.checkpoints import read_json
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)
from omniloop_kit.checkpoints import weight_version as weight_version  # re-exported (family.py: ck.weight_version)

REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
OPTIONAL = ("transformer_2", "image_encoder", "image_processor")
WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
#: the components are loaded by fixed classes (not the index's), so the index's classes are not checked
LAYOUT = kit.Layout(what="a Wan checkpoint", pipelines=WAN_PIPELINES, transformer_class="WanTransformer3DModel",
                    required=REQUIRED, optional=OPTIONAL, tokenizer_files=("tokenizer.json", "spiece.model"),
                    check_classes=False)


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout (omniloop-kit) and Wan2.2's ``boundary_ratio``; return the parsed
    ``model_index.json``. No tensor is loaded."""
    index, present = kit.read_index(root, LAYOUT)
    br = index.get("boundary_ratio")
    if br is not None:
        if not isinstance(br, (int, float)) or not 0.0 < float(br) < 1.0:
            raise CheckpointError(f"{root / 'model_index.json'}: boundary_ratio must be a number in (0, 1), not {br!r}")
        if "transformer_2" not in present:
            raise CheckpointError(f"{root / 'model_index.json'}: boundary_ratio is set but no transformer_2 is declared")
    kit.check_folders(root, LAYOUT, present)
    return index


def limits(path: Path) -> Any:
    """A real checkpoint's trained size (issue 42, ``capabilities.checkpoint_limits``): Wan's
    configs carry no sample size, so its kind's (read from the configs) model-card size
    (``omniloop_wan.defaults``: frames, and the longer side for either side), a ``warn``
    declaration; None for a checkpoint with an ``omniloop.json``."""
    from omniloop_kit.checkpoints import peek_json

    from .defaults import DEFAULTS, model_kind

    root = resolve_root(path)
    kind = model_kind(peek_json(root / "model_index.json") or {}, kit.config_of(root, "transformer"),
                      kit.config_of(root, "vae"))
    d = DEFAULTS.get(kind)
    if d is None:
        return None
    side = max(d["height"], d["width"])
    return kit.sample_size_limits(root, height=side, width=side, frames=d["frames"], source=f"the {kind} model card")


def load(root: Path, index: dict[str, Any], *, device: Any, dtype: Any, vae_dtype: Any) -> dict[str, Any]:
    """Every component Wan runs, by fixed classes (local files only; the transformers and the VAE
    through omniloop-kit's :func:`~omniloop_kit.checkpoint.load_diffusers_weights`), after the
    checks that need the configs (the kind, the I2V image encoder)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from .defaults import model_kind

    present = LAYOUT.components_in(index)
    tf_cfg = read_json(root / "transformer" / "config.json", "transformer config")
    vae_cfg = read_json(root / "vae" / "config.json", "vae config")
    kind = model_kind(index, tf_cfg, vae_cfg)
    if kind == "unknown":
        raise CheckpointError(
            f"{root / 'transformer' / 'config.json'}: in_channels={tf_cfg.get('in_channels')} fits no Wan "
            f"variant (text-to-video: {vae_cfg.get('z_dim', 16)}, image-to-video: "
            f"{2 * int(vae_cfg.get('z_dim', 16)) + 4})"
        )
    image = tf_cfg.get("image_dim") is not None
    if kind == "wan2.1-i2v" and image and "image_encoder" not in present:
        raise CheckpointError(f"{root / 'model_index.json'}: the transformer takes CLIP image states (image_dim="
                              f"{tf_cfg['image_dim']}) but no image_encoder is declared")
    comps = {name: kit.load_diffusers_weights(WanTransformer3DModel, root / name, device=device, dtype=dtype)
             for name in ("transformer", "transformer_2") if name in present}
    comps["vae"] = kit.load_diffusers_weights(AutoencoderKLWan, root / "vae", device=device, dtype=vae_dtype)
    comps["text_encoder"] = kit.load_pretrained(UMT5EncoderModel, root / "text_encoder", device=device, dtype=dtype)
    comps["tokenizer"] = kit.load_tokenizer(root / "tokenizer")
    comps["scheduler"] = kit.load_scheduler(root / "scheduler",
                                            (index.get("scheduler") or [None, None])[1] or "UniPCMultistepScheduler")
    if "image_encoder" in present and image:  # Wan2.1 I2V only: CLIP is not imported for t2v (issue 42, fast start)
        from transformers import CLIPImageProcessor, CLIPVisionModel

        comps["image_encoder"] = kit.load_pretrained(CLIPVisionModel, root / "image_encoder", device=device, dtype=dtype)
        if "image_processor" not in present:
            raise CheckpointError(f"{root / 'model_index.json'}: an image_encoder needs an image_processor")
        comps["image_processor"] = kit.load_tokenizer(root / "image_processor", CLIPImageProcessor)
    return comps
