"""Tiny FLUX.1 checkpoints: same architecture, toy sizes, random weights, diffusers format.

Used by the tests and by anyone who wants to run the whole code path without downloading weights::

    python -m omniloop_flux.tiny OUT_DIR --variant dev

Variants:

* ``dev``     — FLUX.1 [dev]: guidance embedding, dynamic (resolution-dependent) shifting
* ``schnell`` — FLUX.1 [schnell]: no guidance embedding, constant shift 1.0

Every component is written with ``save_pretrained`` (``model_index.json`` names the classes the
way the Black Forest Labs repositories do: ``CLIPTextModel`` + ``CLIPTokenizer``,
``T5EncoderModel`` + ``T5TokenizerFast``). Both tokenizers are built here from a small word list
(a byte-level BPE for CLIP, a Unigram vocabulary for T5) — nothing is downloaded. Deterministic in
``seed``; the global torch RNG is left untouched.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import clip_bpe_tokenizer, tiny_command, write_model_index, write_omniloop_json, write_scheduler

VARIANTS = ("dev", "schnell")

_WORDS = (
    "a an the of in on at with and or to from over under fox cat dog bird fish horse "
    "runs jumps flies swims walks sits red blue green yellow black white small big lazy quick "
    "photo portrait scene forest city river sky sea snow night day light dark square circle "
    "painting drawing beautiful blurry low quality"
).split()

#: defaults written to ``omniloop.json``: tiny sizes so that a default request runs in a blink
TINY_DEFAULTS: dict[str, Any] = {"steps": 2, "height": 64, "width": 64, "max_sequence_length": 32}

#: the scheduler configs the FLUX.1 repositories ship
SCHEDULERS: dict[str, dict[str, Any]] = {
    "dev": {
        "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
    },
    "schnell": {
        "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
        "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
    },
}


def build_clip_tokenizer(out: Path, max_length: int = 77) -> int:
    """Write a CLIP byte-level BPE tokenizer (every byte, a few whole words); returns its vocab size."""
    return clip_bpe_tokenizer(out, _WORDS, max_length)


def build_t5_tokenizer(out: Path, max_length: int = 512) -> int:
    """Write a T5-style Unigram tokenizer; returns its vocab size."""
    from transformers import T5Tokenizer

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in _WORDS]
    letters = string.ascii_letters + string.digits
    vocab += [("\u2581" + c, -8.0) for c in letters]
    vocab += [(c, -9.0) for c in letters + string.punctuation]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
    tok.save_pretrained(str(out))
    return len(tok)


#: a ``FluxPipeline``'s components (``model_index.json``): library and class of each
MODEL_INDEX: dict[str, list[str]] = {
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def build_tiny_checkpoint(path: str | Path, variant: str = "dev", seed: int = 0, **transformer: Any) -> Path:
    """Write a tiny FLUX.1 checkpoint of ``variant`` (``dev`` or ``schnell``) to ``path``; return it.

    ``transformer`` overrides the tiny transformer's config (e.g. ``num_layers=2,
    num_single_layers=4`` for more blocks to cache)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    clip_vocab = build_clip_tokenizer(out / "tokenizer")
    t5_vocab = build_t5_tokenizer(out / "tokenizer_2")
    from transformers import CLIPTokenizer

    eos = CLIPTokenizer.from_pretrained(str(out / "tokenizer")).eos_token_id
    clip_dim, t5_dim, latent = 32, 32, 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_cfg = CLIPTextConfig(
            vocab_size=clip_vocab, hidden_size=clip_dim, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=clip_dim, hidden_act="gelu",
            bos_token_id=clip_vocab - 2, eos_token_id=eos, pad_token_id=eos,
        )
        CLIPTextModel(clip_cfg).eval().save_pretrained(out / "text_encoder")
        t5_cfg = T5Config(
            vocab_size=t5_vocab, d_model=t5_dim, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
        T5EncoderModel(t5_cfg).eval().save_pretrained(out / "text_encoder_2")
        AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 8, 8, 8], layers_per_block=1,
            latent_channels=latent, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
        ).eval().save_pretrained(out / "vae")
        FluxTransformer2DModel(**{**dict(
            patch_size=1, in_channels=4 * latent, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=t5_dim, pooled_projection_dim=clip_dim,
            guidance_embeds=variant == "dev", axes_dims_rope=(4, 6, 6)), **transformer},
        ).eval().save_pretrained(out / "transformer")

    write_scheduler(out, "FlowMatchEulerDiscreteScheduler", SCHEDULERS[variant])
    write_model_index(out, "FluxPipeline", MODEL_INDEX)
    write_omniloop_json(out, f"tiny-{variant}", TINY_DEFAULTS)
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_flux.tiny", what="FLUX.1", doc=__doc__ or "",
                    variants=VARIANTS, default="dev")


if __name__ == "__main__":
    sys.exit(main())
