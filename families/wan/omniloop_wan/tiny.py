"""Tiny Wan checkpoints: same architecture, toy sizes, random weights, diffusers format.

Used by the tests and by anyone who wants to run the whole code path without downloading weights::

    python -m omniloop_wan.tiny OUT_DIR --variant t2v

Variants:

* ``t2v``       — Wan2.1 text-to-video (one transformer, UniPC flow scheduler)
* ``wan22``     — Wan2.2 A14B text-to-video (``transformer`` + ``transformer_2``, ``boundary_ratio``)
* ``i2v``       — Wan2.1 image-to-video (36 input channels, CLIP image encoder + processor)
* ``wan22_i2v`` — Wan2.2 A14B image-to-video (36 input channels, two experts, no image encoder)
* ``ti2v``      — Wan2.2 TI2V-5B (48-channel residual VAE with patching, ``expand_timesteps``)

Every component is written with ``save_pretrained``; the tokenizer is a real ``tokenizer.json``
(a small Unigram vocabulary built with the ``tokenizers`` library) that loads through
``transformers.AutoTokenizer``. A few hundred KB, built in well under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import (
    t5_encoder_config,
    t5_unigram_tokenizer,
    tiny_command,
    write_model_index,
    write_omniloop_json,
    write_scheduler,
)

VARIANTS = ("t2v", "wan22", "i2v", "wan22_i2v", "ti2v")

#: text context length: Wan's attention processor hard-codes 512 text tokens for I2V
TEXT_LEN = 512

_WORDS = (
    "a an the of in on at with and or to from over under fox cat dog bird fish horse "
    "runs jumps flies swims walks sits red blue green yellow black white small big lazy quick "
    "video photo scene forest city river sky sea snow night day light dark slow fast camera "
    "pan zoom close up wide shot beautiful ugly blurry static low quality worst"
).split()

#: defaults written to ``omniloop.json``: tiny sizes so that a default request runs in a blink
TINY_DEFAULTS: dict[str, Any] = {
    "steps": 2,
    "guidance_scale": 5.0,
    "height": 32,
    "width": 32,
    "frames": 9,
    "fps": 16.0,
}


def build_tokenizer(out: Path) -> None:
    """Write a T5-style Unigram tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)."""
    t5_unigram_tokenizer(out, _WORDS, pair=True)
    (out / "special_tokens_map.json").write_text(
        json.dumps({"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )


def _vocab_size(tokenizer_dir: Path) -> int:
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    return len(data["model"]["vocab"])


def _scheduler_config(variant: str, scheduler: str) -> tuple[str, dict[str, Any]]:
    shift = {"t2v": 3.0, "wan22": 12.0, "i2v": 3.0, "wan22_i2v": 5.0, "ti2v": 5.0}[variant]
    if scheduler == "flow_euler":
        return "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": shift}
    # the scheduler config the Wan-AI diffusers checkpoints ship, with this variant's shift
    from omniloop_policies.testing import WAN_UNIPC_CONFIG

    config = {k: v for k, v in WAN_UNIPC_CONFIG.items() if not k.startswith("_")}
    return "UniPCMultistepScheduler", {**config, "flow_shift": shift}


def build_tiny_checkpoint(
    path: str | Path, variant: str = "t2v", seed: int = 0, scheduler: str = "unipc"
) -> Path:
    """Write a tiny Wan checkpoint of ``variant`` to ``path`` and return the path.

    ``scheduler`` is ``unipc`` (what Wan-AI ships) or ``flow_euler``. Deterministic in ``seed``;
    the global torch RNG is left untouched.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    if scheduler not in ("unipc", "flow_euler"):
        raise ValueError(f"scheduler must be 'unipc' or 'flow_euler', not {scheduler!r}")
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    two_experts = variant in ("wan22", "wan22_i2v")
    image_latent = variant in ("i2v", "wan22_i2v")
    with_clip = variant == "i2v"
    ti2v = variant == "ti2v"

    build_tokenizer(out / "tokenizer")
    text_dim = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        te_config = UMT5Config(**t5_encoder_config(_vocab_size(out / "tokenizer"), text_dim, d_kv=8, d_ff=64,
                                                   max_distance=32))
        UMT5EncoderModel(te_config).eval().save_pretrained(out / "text_encoder")

        z_dim = 48 if ti2v else 16
        vae_kwargs: dict[str, Any] = dict(
            base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        if ti2v:
            vae_kwargs.update(
                is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
            )
        AutoencoderKLWan(**vae_kwargs).eval().save_pretrained(out / "vae")

        image_dim = None
        if with_clip:
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            image_dim = 16
            clip_cfg = CLIPVisionConfig(
                hidden_size=image_dim, projection_dim=16, num_hidden_layers=2, num_attention_heads=2,
                image_size=32, intermediate_size=32, patch_size=8,
            )
            CLIPVisionModel(clip_cfg).eval().save_pretrained(out / "image_encoder")
            CLIPImageProcessor(crop_size=32, size=32).save_pretrained(out / "image_processor")

        heads, head_dim = 2, 12
        inner = heads * head_dim
        in_channels = z_dim + (4 + z_dim if image_latent else 0)
        tf_kwargs: dict[str, Any] = dict(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=in_channels, out_channels=z_dim, text_dim=text_dim, freq_dim=32, ffn_dim=32,
            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            image_dim=image_dim, added_kv_proj_dim=inner if with_clip else None, rope_max_seq_len=32,
        )
        WanTransformer3DModel(**tf_kwargs).eval().save_pretrained(out / "transformer")
        if two_experts:
            WanTransformer3DModel(**tf_kwargs).eval().save_pretrained(out / "transformer_2")

    sched_cls, sched_cfg = _scheduler_config(variant, scheduler)
    write_scheduler(out, sched_cls, sched_cfg)

    index: dict[str, Any] = {
        "scheduler": ["diffusers", sched_cls],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if two_experts:
        index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
        index["boundary_ratio"] = 0.875 if variant == "wan22" else 0.9
    elif image_latent:
        index["transformer_2"] = [None, None]
    if with_clip:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    elif image_latent:
        index["image_encoder"] = [None, None]
        index["image_processor"] = [None, None]
    if ti2v:
        index["expand_timesteps"] = True
    write_model_index(out, "WanImageToVideoPipeline" if image_latent else "WanPipeline", index)

    defaults = dict(TINY_DEFAULTS)
    if ti2v:
        defaults.update(height=64, width=64)
    write_omniloop_json(out, f"tiny-{variant}", defaults)
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_wan.tiny", what="Wan", doc=__doc__ or "",
                    variants=VARIANTS, default="t2v",
                    options=[("--scheduler", {"choices": ("unipc", "flow_euler"), "default": "unipc"})],
                    convert=lambda args: {"scheduler": args.scheduler})


if __name__ == "__main__":
    sys.exit(main())
